"""Qwen Code 0.24.4 (the pinned npm package, unmodified) on a real node against the gateway's OpenAI Chat.

The fake vLLM plays the model and makes the CLI call its own `run_shell_command` tool to write hello.txt,
then answers. Run in the `local` runtime and in `bwrap` with only the gateway reachable (the proof that it
needs no other connection); one run re-enables managed auto-memory to see its background call tagged, one
has it start a subagent and a fork and check who speaks next, and one runs 0.15.10 (the previous pin) to see
the main-loop marker hold for both.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from polar.gateway.fit import requested_flag
from polar.harness import HarnessContext, cli_common, get_harness
from polar.harness.presets import qwen_code
from polar.rollout.protocol import SessionStatus
from polar.store.records import FLAG_MAX_TOKENS_CLAMPED, CompletionRecord
from polar.trajectory import audit, build
from polar.trajectory.retries import DEAD_BRANCH, RETRY, tag_retries
from tests import extension_support as ext
from tests import mcp_weather
from tests.fakes.chatml import FakeTokenizer
from tests.fakes.fake_vllm import Reply
from tests.preset_run_support import (
    captured_record,
    check_capture,
    needs_bwrap,
    needs_strace,
    offered_tool_script,
    run_preset,
    traced_against_gateway,
)

pytestmark = pytest.mark.cli

CONTENT = "hello from qwen"
# Compact JSON: Qwen Code re-serializes tool-call arguments (spaces removed) when it replays history.
WRITE = '{"command":"printf \'hello from qwen\' > hello.txt"}'


def _streamed(record: CompletionRecord) -> bool:
    return record.request.get("stream") is True and record.request["stream_options"] == {
        "include_usage": True
    }


@pytest.mark.parametrize("backend", ["local", pytest.param("bwrap", marks=needs_bwrap)])
async def test_qwen_code_writes_the_file_and_captures_one_trace(tmp_path: Path, backend: str) -> None:
    script = offered_tool_script("run_shell_command", WRITE, "Done.")
    local = backend == "local"
    run = await run_preset(tmp_path, "qwen_code", {}, script, expect=CONTENT, backend=backend)
    main = check_capture(run, "qwen_code", {}, "chat")
    assert len(main) == len(run.records) == 2  # auto-memory off: no background call
    assert all(_streamed(r) for r in run.records)  # SSE with usage, in its own dialect
    assert {r.model_requested for r in run.records} == {"fake-policy"}
    if local:  # nothing else reached the gateway either (no model listing)
        assert run.routes == [("POST", "/v1/chat/completions", "")] * 2, run.routes
    # What it replays: the call with compact arguments, the result as an array of text parts.
    replay = main[1].request["messages"]
    call = next(m for m in replay if m["role"] == "assistant" and m.get("tool_calls"))
    assert call["tool_calls"][0]["function"]["arguments"] == WRITE
    result = next(m for m in replay if m["role"] == "tool")
    assert result["tool_call_id"] == main[0].response_message["tool_calls"][0]["id"]
    assert isinstance(result["content"], list) and result["content"][0]["type"] == "text"
    assert run.result.metadata["harness"]["transcript_files"] >= 1
    chats = list((run.artifacts / "qwen").rglob("chats/*.jsonl"))
    assert chats and CONTENT in chats[0].read_text()


@pytest.mark.parametrize("memory", [False, True])
async def test_qwen_code_memory_extraction_is_off_or_a_tagged_side_call(tmp_path: Path, memory: bool) -> None:
    """Qwen Code runs a memory extraction agent (with tools) after a user turn that ends without tool calls.
    The preset turns it off; a task that turns it back on gets it captured, asked of the served model and
    tagged, and the main loop stays its own trace."""

    def script(body: dict[str, Any]) -> Reply:
        system = body["messages"][0]["content"]
        return Reply(content="Nothing durable." if "memory extraction" in system else "Nothing to do.")

    settings: dict[str, Any] = {"config": {"memory": {"enableManagedAutoMemory": True}}} if memory else {}
    run = await run_preset(tmp_path, "qwen_code", settings, script, expect=None)
    assert run.result.status == SessionStatus.COMPLETED and run.result.reason is None, run.result.reason
    assert len(run.records) == len(run.fake.requests) == (2 if memory else 1)
    assert all(r.trainable and _streamed(r) for r in run.records)
    harness = get_harness("qwen_code", settings)
    expected = [(), ("side_call", "memory_extraction")] if memory else [()]
    assert [harness.classify(r) for r in run.records] == expected
    assert all(r.tools for r in run.records)  # only its system prompt tells the extraction from the main loop
    assert {r.model_requested for r in run.records} == {"fake-policy"}
    trajectory = build(run.records[:1], strategy="prefix_merging")
    assert len(trajectory.traces) == 1 and audit(trajectory, run.records[:1]).ok


SUB_ANSWER = "Only hello.txt may be here."
FORK_ANSWER = "Scope: the fork check. Result: nothing to do."
FORK_TASK = "Fork check"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def _subagent_script(fork: bool) -> Any:
    """The main loop starts a general-purpose subagent, then (0.24) a fork, writes hello.txt and answers;
    the subagent and the fork answer at once, a next-speaker check says the user speaks. Each call is told
    by what the CLI put in it, never by the preset's classifier."""

    def script(body: dict[str, Any]) -> Reply:
        tools = [t["function"]["name"] for t in body.get("tools") or []]
        messages = body["messages"]
        if tools == ["respond_in_schema"]:
            return Reply(tool_calls=[("respond_in_schema", '{"reasoning":"Done.","next_speaker":"user"}')])
        system = _text(messages[0]["content"]) if messages[0]["role"] == "system" else ""
        if system.startswith("You are a general-purpose"):  # both versions' built-in subagent
            return Reply(content=SUB_ANSWER)
        if any(
            m["role"] == "user" and f"Directive: {FORK_TASK}" in _text(m.get("content")) for m in messages
        ):
            return Reply(content=FORK_ANSWER)  # the fork: the main loop's prompt, its task as a user message
        asks = [("agent", {"description": "look around", "prompt": "List the files here.",
                           "subagent_type": "general-purpose"})]  # fmt: skip
        if fork:
            asks.append(
                ("agent", {"description": "fork check", "prompt": FORK_TASK, "subagent_type": "fork"})
            )
        done = sum(1 for m in messages if m["role"] == "tool")
        if done < len(asks):
            name, args = asks[done]
            return Reply(content=f"Agent {done}.", tool_calls=[(name, json.dumps(args))])
        if done == len(asks):
            return Reply(content="Writing.", tool_calls=[("run_shell_command", WRITE)])
        return Reply(content="Done.")

    return script


@pytest.mark.parametrize("version", [qwen_code.VERSION, "0.15.10"])
async def test_qwen_code_subagents_forks_and_side_queries_are_tagged_and_the_main_loop_is_one_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """The main loop is told by its system prompt ("You are Qwen Code, <role> developed by Alibaba Group":
    0.15.10 says "an interactive CLI agent", 0.24 under -p "a non-interactive CLI agent"). A subagent has its
    own prompt; 0.24's fork has the main loop's prompt and is told by the task it starts with; the
    next-speaker check (turned on here) offers only `respond_in_schema`. The main loop stays one trace."""
    monkeypatch.setenv("POLAR_TOOL_VERSIONS", json.dumps({qwen_code.PACKAGE: version}))
    fork = version != "0.15.10"  # 0.15.10 has no forks
    settings = {"config": {"model": {"skipNextSpeakerCheck": False}}}
    run = await run_preset(tmp_path, "qwen_code", settings, _subagent_script(fork), expect=CONTENT)
    main = check_capture(run, "qwen_code", settings, "chat", allow_subagents=True)
    assert {r.model_requested for r in run.records} == {"fake-policy"}

    def expected(record: CompletionRecord) -> tuple[str, ...]:
        answer = record.response_message
        if [c["function"]["name"] for c in answer.get("tool_calls") or []] == ["respond_in_schema"]:
            return ("side_call", "json_query")
        return ("subagent",) if answer.get("content") in (SUB_ANSWER, FORK_ANSWER) else ()

    got = [run.preset.classify(r) for r in run.records]
    assert got == [expected(r) for r in run.records], got
    answers = {r.response_message.get("content") for r in run.records}
    assert SUB_ANSWER in answers and (FORK_ANSWER in answers) == fork, answers
    assert ("side_call", "json_query") in got
    assert [r.response_message.get("content") for r in main][:2] == [
        "Agent 0.",
        "Agent 1." if fork else "Writing.",
    ]


@needs_strace
async def test_qwen_code_connects_to_nothing_but_the_gateway(tmp_path: Path) -> None:
    """Not just "works without a network" (bwrap): every internet socket the CLI and its children open, even
    a failed attempt (DNS, telemetry, update check), goes to the gateway."""
    result, connections, port = await traced_against_gateway(
        tmp_path, "qwen_code", offered_tool_script("run_shell_command", WRITE, "Done.")
    )
    assert result.exit_code == 0, result.stderr[-2000:]
    assert connections and set(connections) == {("127.0.0.1", port)}, connections


async def test_qwen_code_escalates_max_tokens_after_a_cut_answer(tmp_path: Path) -> None:
    """LIMITS: after finish_reason=length Qwen Code resends the same prompt with max_tokens 64000 (0.24 asks
    for 32000 first, 0.15.10 for 8000), then asks the model to resume; every attempt is captured."""
    cut = Reply(content="This answer is cut o", finish_reason="length")
    run = await run_preset(tmp_path, "qwen_code", {}, lambda body: cut, expect=None)
    assert run.result.reason is None, run.result.reason
    first, again, resume = run.records[:3]
    assert [r.request["max_tokens"] for r in (first, again)] == [32000, 64000]
    assert again.request["messages"] == first.request["messages"]
    said = resume.request["messages"][-1]["content"][0]["text"]
    assert said.startswith("Output token limit hit.")
    assert all(r.finish_reason == "length" and r.trainable for r in run.records)


async def test_qwen_code_escalation_beyond_the_context_is_cut_to_fit(tmp_path: Path) -> None:
    """A server whose context is under 64000 tokens refuses the escalated call (vLLM 0.32: "max_tokens=64000
    cannot be greater than max_model_len"); the gateway sends it again with what fits, so the session goes
    on instead of ending on a 400, and the record says it was cut and from what."""
    cut = Reply(content="This answer is cut o", finish_reason="length")
    limit = 63_999  # about 16k of it is the prompt, at 4 bytes a token (Qwen's real tokenizer is close)
    faults = {"max_model_len": limit, "context_checks": "0.32", "tokenizer": FakeTokenizer(4)}
    run = await run_preset(tmp_path, "qwen_code", {}, lambda body: cut, expect=None, backend_faults=faults)
    assert run.result.reason is None, run.result.reason
    first, again = run.records[:2]
    assert [r.request["max_tokens"] for r in (first, again)] == [32000, 64000]
    assert FLAG_MAX_TOKENS_CLAMPED not in first.flags and first.upstream_request["max_tokens"] == 32000
    assert again.prompt_ids is not None
    assert again.upstream_request["max_tokens"] == limit - len(again.prompt_ids)
    assert FLAG_MAX_TOKENS_CLAMPED in again.flags and requested_flag(64000) in again.flags
    # Every escalated call was refused once by the server and sent again; the harness saw no 400.
    refused = [b for b in run.fake.requests if b["max_tokens"] == 64000]
    assert len(refused) == len(run.records) - 1
    assert all(r.trainable for r in run.records)
    # The ids of the prompt are the whole prompt, as the server counted it (the memo of the session's
    # previous prompt decodes only the new tail, and must still give every id).
    assert all(len(r.prompt_ids or ()) == r.usage["prompt_tokens"] for r in run.records)


async def test_qwen_code_retry_after_a_cut_answer_leaves_a_dead_branch_dropped_from_the_trace(
    tmp_path: Path,
) -> None:
    """The resend after `finish_reason=length` is a real retry: the cut answer was recorded but never
    entered the conversation. It is tagged `dead_branch` (its resend `retry`), and `dead_branches: drop`
    builds the session as one trace without it (today's build, "train", makes two)."""
    replies = iter([Reply(content="This answer is cut o", finish_reason="length"), Reply(content="Done.")])
    run = await run_preset(tmp_path, "qwen_code", {}, lambda body: next(replies), expect=None)
    assert run.result.reason is None, run.result.reason
    cut, again = run.records
    assert again.upstream_request["messages"] == cut.upstream_request["messages"]
    tagged = tag_retries(run.records)
    assert [r.tags for r in tagged] == [(DEAD_BRANCH,), (RETRY,)]
    assert len(build(run.records, strategy="prefix_merging").traces) == 2
    for policy, traces in (("drop", 1), ("mask", 2)):
        trajectory = build(run.records, strategy="prefix_merging", dead_branches=policy)
        assert len(trajectory.traces) == traces and audit(trajectory, run.records).ok
        assert trajectory.traces[-1].metadata["completion_ids"] == [again.completion_id]
    masked = build(run.records, strategy="prefix_merging", dead_branches="mask").traces[0]
    assert masked.metadata["completion_ids"] == [cut.completion_id] and not any(masked.loss_mask)


def _record(request: dict[str, Any], tools: bool) -> CompletionRecord:
    return captured_record("chat", request, tools=tools)


def _system(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}


MAIN_0_15 = "You are Qwen Code, an interactive CLI agent developed by Alibaba Group, specializing in software"
MAIN_0_24 = (
    "You are Qwen Code, a non-interactive CLI agent developed by Alibaba Group, specializing in software"
)
ACP_0_24 = (
    "You are Qwen Code, a CLI agent operating through an ACP host developed by Alibaba Group, specializing"
)


def test_classify_background_agents_subagents_and_untooled_calls() -> None:
    harness = get_harness("qwen_code")
    for main in (MAIN_0_15, MAIN_0_24, ACP_0_24):
        assert harness.classify(_record(_system(main + " engineering tasks."), tools=True)) == (), main
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": MAIN_0_24}]}]}
    assert harness.classify(_record(parts, tools=True)) == ()
    # /init's prompt names Qwen Code too, but as a user message; a system prompt saying so is not the loop
    init = _system("You are Qwen Code, an interactive CLI agent. Analyze the current directory and generate")
    assert harness.classify(_record(init, tools=True)) == ("subagent",)
    title = _system("Generate a concise, sentence-case title (3-7 words) that captures ...")
    assert harness.classify(_record(title, tools=False)) == ("side_call", "title")
    assert harness.classify(_record(_system("You are a test-fixing agent."), tools=True)) == ("subagent",)
    assert harness.classify(_record({"messages": []}, tools=False)) == ("side_call", "no_tools")
    fork = _system(MAIN_0_24)
    fork["messages"].append(
        {"role": "user", "content": [{"type": "text", "text": "<fork-boilerplate>\nSTOP."}]}
    )
    assert harness.classify(_record(fork, tools=True)) == ("subagent",)


def test_classify_a_json_side_query_by_its_one_tool() -> None:
    """The next-speaker check sends no system prompt and only `respond_in_schema`, forced."""
    harness = get_harness("qwen_code")
    body = {
        "messages": [{"role": "user", "content": "Analyze *only* the content"}],
        "tool_choice": "required",
    }
    tool = {"type": "function", "function": {"name": "respond_in_schema", "parameters": {"type": "object"}}}
    record = replace(captured_record("chat", body, tools=True), tools=[tool])
    assert harness.classify(record) == ("side_call", "json_query")


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"extra_args": "--debug"}, "settings.extra_args"),
        ({"config": "x"}, "settings.config"),
        ({"yolo": False}, "unknown settings ['yolo']"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=r"qwen_code harness: .*") as err:
        get_harness("qwen_code", settings)
    assert field in str(err.value)


def test_command_env_and_settings_file() -> None:
    harness = qwen_code.QwenCodeHarness({"config": {"general": {"vimMode": True}}})
    ctx = HarnessContext("sid-2", "http://127.0.0.1:9", "served", "do it", "/h", "/w", "/a", env={"X": "1"})
    with pytest.raises(RuntimeError, match="before setup"):
        harness.command(ctx)
    harness.binary = Path("/tools/qwen")
    assert harness.command(ctx) == ["/tools/qwen", "--yolo", "-p", "do it"]
    env = harness.env(ctx)
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and env["OPENAI_API_KEY"] == "sid-2"
    assert env["OPENAI_MODEL"] == "served" and env["X"] == "1"
    merged = cli_common.deep_merge(qwen_code.cli_settings(), harness.config)
    assert merged["general"] == {"enableAutoUpdate": False, "vimMode": True}
    assert json.loads(json.dumps(merged))["memory"] == {"enableManagedAutoMemory": False}


# 0.24.4 defers MCP tools (`shouldDefer`, and no preload: tools.toolSearch.threshold is 0 by default): the
# model calls one through the `tool_call` bridge, by the name a reminder gives it.
BRIDGED = '{"name":"mcp__weather__forecast","arguments":{"city":"Oslo"}}'


async def test_qwen_code_runs_the_tasks_mcp_server_and_reads_its_skill(tmp_path: Path) -> None:
    """`agent.mcp_servers` and `agent.skills`: a reminder in the first request names the deferred
    `mcp__weather__forecast`, the policy calls it through `tool_call` (no `tool_search` needed) and the
    forecast comes back in the next request. 0.24.4 waits for its servers (the server starts 3 s late)."""
    await asyncio.to_thread(mcp_weather.install)
    run = await run_preset(
        tmp_path,
        "qwen_code",
        {},
        ext.weather_script("tool_call", BRIDGED),
        expect=None,
        agent=ext.agent_fields(delay_s=3),
    )
    main = ext.check_weather_run(
        run, "qwen_code", "chat", "tool_call", arguments=BRIDGED, named="mcp__weather__forecast"
    )
    assert "mcp__weather__forecast" in json.dumps(main[0].upstream_request["messages"])
