"""bench/harnesses.py's compaction and discovery scenarios with the real, pinned CLIs: each CLI's own
trigger fires (or, for Gemini CLI, provably cannot), the recorded traffic shows the summary call and the
rewritten history, and the trajectory names the break. And its loop behind the real vLLM (`--vllm`): a
session stays one chain on the server's own tokens."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import pytest
from bench import harnesses as depth

from polar.harness import get_harness
from polar.store.records import CompletionRecord
from polar.store.sqlite import SQLiteStore

pytestmark = [
    pytest.mark.cli,
    pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed"),
]
STEPS = 10


def cli(name: str) -> depth.CLI:
    return next(c for c in depth.CLIS if c.harness == name)


async def run(tmp_path: Path, name: str, scenario: str) -> tuple[depth.Row, list[CompletionRecord], Any]:
    row = await depth.run_one(cli(name), STEPS, tmp_path, scenario)
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions(f"depth-{name}")
    twist = depth.TWISTS[scenario][name]
    return row, records, get_harness(name, dict(twist.settings))


@pytest.mark.parametrize("name", ["claude_code", "qwen_code", "opencode"])
async def test_compaction_fires_and_the_main_loop_goes_on_in_a_new_chain(tmp_path: Path, name: str) -> None:
    row, records, preset = await run(tmp_path, name, "compaction")
    assert row.status == "COMPLETED" and row.steps_done == STEPS and row.audit_ok, row
    summaries = [r for r in records if preset.classify(r) == ("side_call", "compaction")]
    assert summaries, [preset.classify(r) for r in records]
    # Every summary rewrites the main loop's history: the next main call carries the summary's text and a
    # shorter prompt than the last main call before it; the trajectory splits there as `compaction`.
    for summary in summaries:
        main = [r for r in records if not preset.classify(r)]
        before = max((r for r in main if r.seq < summary.seq), key=lambda r: r.seq)
        after = min((r for r in main if r.seq > summary.seq), key=lambda r: r.seq)
        assert str(summary.response_message["content"]) in str(after.upstream_request["messages"])
        assert len(after.prompt_ids or []) < len(before.prompt_ids or [])
    # Qwen Code 0.24.4 summarizes on a fork of the main loop (its prompt and tools, "Do not call tools"), goes on
    # from the compacted history without its skills <system-reminder> and puts the reminder back into the next
    # call's history, a second rewrite, longer than the prompt before it: a chain the builder starts as `root`.
    assert row.breaks == {"compaction": len(summaries)}, row
    assert row.merged == len(summaries) * (2 if name == "qwen_code" else 1) + 1, row
    if name == "qwen_code":  # the fork, not the tool-less summarizer: the policy answered with a snapshot
        assert all(s.tools and "<state_snapshot>" in str(s.response_message["content"]) for s in summaries)


async def test_gemini_cli_headless_session_never_compresses(tmp_path: Path) -> None:
    """Gemini CLI 0.61.0 passes its threshold but splits history only before a user message that is not a
    tool response; a headless session has one, the first, so there is nothing to compress (a no-op)."""
    row, records, preset = await run(tmp_path, "gemini_cli", "compaction")
    assert row.status == "COMPLETED" and row.steps_done == STEPS and row.audit_ok, row
    threshold = 0.054 * 1048576  # the scenario's compressionThreshold x the unknown model's token limit
    assert max(r.usage["prompt_tokens"] for r in records) > threshold
    assert [preset.classify(r) for r in records] == [()] * len(records)
    assert row.breaks == {} and row.merged == 1


async def test_a_tool_search_adds_the_tool_and_splits_as_tools_changed(tmp_path: Path) -> None:
    name = "claude_code"
    row, records, preset = await run(tmp_path, name, "discovery")
    assert row.status == "COMPLETED" and row.steps_done == STEPS and row.audit_ok, row
    search, args = depth.SEARCH[name]
    loaded = args.split("select:")[1].split('"')[0]
    (at,) = [i for i, r in enumerate(records) if search in str(r.response_message.get("tool_calls"))]
    names = [{t["function"]["name"] for t in r.tools or []} for r in records]
    assert all(loaded not in n for n in names[: at + 1]) and all(loaded in n for n in names[at + 1 :])
    assert all(not preset.classify(r) for r in records)
    assert row.breaks == {"tools_changed": 1} and row.merged == 2, row


async def test_qwen_code_tool_search_returns_the_schema_and_leaves_tools_alone(tmp_path: Path) -> None:
    """Qwen Code 0.24.4's tool_search "reviews function declarations for deferred tools without changing the
    active tool list": the schema comes back as the tool result, the model would call it through
    `tool_call`, and the tool list of every call stays the same, so the main loop stays one chain."""
    row, records, preset = await run(tmp_path, "qwen_code", "discovery")
    assert row.status == "COMPLETED" and row.steps_done == STEPS and row.audit_ok, row
    search, args = depth.SEARCH["qwen_code"]
    loaded = args.split("select:")[1].split('"')[0]
    (at,) = [i for i, r in enumerate(records) if search in str(r.response_message.get("tool_calls"))]
    result = records[at + 1].upstream_request["messages"][-1]
    assert result["role"] == "tool" and f'<function>{{"name":"{loaded}"' in str(result["content"])
    names = [{t["function"]["name"] for t in r.tools or []} for r in records]
    assert all(n == names[0] for n in names) and loaded not in names[0] and "tool_call" in names[0]
    assert all(not preset.classify(r) for r in records)
    assert row.breaks == {} and row.merged == 1, row


async def test_codex_tool_search_loads_the_mcp_tools_into_the_tool_message_and_stays_one_chain(
    tmp_path: Path,
) -> None:
    """Codex 0.171.0 with an MCP server whose tools it defers: the search's result reaches the policy as the
    tool message listing the loaded functions, `tools` never change, the main loop stays one chain."""
    row, records, _ = await run(tmp_path, "codex", "discovery")
    assert row.status == "COMPLETED" and row.steps_done == STEPS and row.audit_ok, row
    search, _args = depth.SEARCH["codex"]
    (at,) = [i for i, r in enumerate(records) if search in str(r.response_message.get("tool_calls"))]
    found = [m for m in records[at + 1].upstream_request["messages"] if m["role"] == "tool"][-1]
    assert "mcp__weather__forecast" in str(found["content"])
    names = [[t["function"]["name"] for t in r.tools or []] for r in records]
    assert all(n == names[0] for n in names) and "tool_search" in names[0]
    assert row.breaks == {} and row.merged == 1, row


@pytest.mark.vllm
async def test_a_session_on_the_real_vllm_stays_one_chain(tmp_path: Path, vllm_server: Any) -> None:
    """Pi through the gateway to the real vLLM, the scripted turns forced token by token (tests/vllm_scripted):
    vLLM's hermes parser hands back each turn's text with the newline before `<tool_call>` in it, and the
    Qwen3 template adds its own; the gateway takes one off upstream, so every prompt extends the last one
    plus the tokens vLLM sampled, and the session is one trace (before the fix: a drift at every turn)."""
    row = await depth.run_one(cli("pi"), 4, tmp_path, "loop", vllm_server)
    assert row.status == "COMPLETED" and row.steps_done == 4 and row.audit_ok, row
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions("depth-pi")
    called = [r for r in records if r.response_message.get("tool_calls")]
    assert called and all(str(r.response_message["content"]).endswith("\n") for r in called)  # vLLM's
    assert all(r.response_ids and r.response_logprobs for r in records)  # the server's own tokens
    later = [r for r in records if r.seq > called[0].seq]
    assert later and all("quirk:tool_call_separator_restored" in r.flags for r in later)
    for prev, nxt in itertools.pairwise(records):
        sampled = list(prev.prompt_ids or []) + list(prev.response_ids or [])
        assert list(nxt.prompt_ids or [])[: len(sampled)] == sampled
    assert row.breaks == {} and row.drift == 0 and row.merged == 1 and row.per_request == len(records), row


@pytest.mark.vllm
async def test_rendered_by_the_gateway_a_session_is_one_chain_without_quirks(
    tmp_path: Path, vllm_server: Any
) -> None:
    """The same Pi session with `render: gateway`: the gateway renders with the model's tokenizer and sends
    token ids to vLLM's /v1/completions (the relay reads each back into the chat call the script answers).
    One chain from the first call to the last, so one trace: the prompts hold the ids vLLM sampled, whatever
    the history's text says (the separator quirk still restores the newline there; the chain ignores it)."""
    row = await depth.run_one(cli("pi"), 4, tmp_path, "loop", vllm_server, render="gateway")
    assert row.status == "COMPLETED" and row.steps_done == 4 and row.audit_ok, row
    with SQLiteStore(tmp_path / "node.db") as store:
        records = store.completions("depth-pi")
    assert all("render:gateway" in r.flags and r.trainable for r in records)
    assert [r.seq for r in records if "chain:first" in r.flags] == [records[0].seq] and row.chains == 1
    assert all(r.response_message.get("tool_calls") for r in records[:-1])  # parsed by the gateway
    assert row.breaks == {} and row.drift == 0 and row.merged == 1, row


@pytest.mark.vllm
def test_the_relay_makes_vllm_sample_exactly_the_scripted_turn(vllm_server: Any) -> None:
    """The stand-in's contract (tests/vllm_scripted.py): vLLM samples the forced ids, each with logprob 0.0,
    parses them as its hermes parser parses a model's tool call, and refuses a malformed script."""
    import httpx

    from tests.fakes.fake_vllm import Reply
    from tests.vllm_scripted import ScriptedRelay, relayed

    reply = Reply(content="Looking.", tool_calls=[("bash", '{"command":"ls"}')])
    body = {
        "model": vllm_server.name,
        "messages": [{"role": "user", "content": "go"}],
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
        "return_token_ids": True,
        "logprobs": True,
    }
    with relayed(vllm_server.url, vllm_server.model_dir, lambda _: reply) as url:
        out = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    forced = ScriptedRelay(vllm_server.url, vllm_server.model_dir, lambda _: reply).forced_ids(reply)
    assert out["token_ids"] == forced
    assert [t["logprob"] for t in out["logprobs"]["content"]] == [0.0] * len(forced)
    call = out["message"]["tool_calls"][0]["function"]
    assert (call["name"], call["arguments"]) == ("bash", '{"command": "ls"}')
    assert out["message"]["content"] == "Looking.\n"  # the parser keeps the newline before <tool_call>
    bad = httpx.post(
        f"{vllm_server.url}/v1/chat/completions",
        json={**body, "vllm_xargs": {"polar_forced": "x"}},
        timeout=60,
    )
    assert bad.status_code == 400, bad.text
