"""The `pi` preset runs the real Pi coding agent (npm @mariozechner/pi-coding-agent, pinned) on a node in each
of its four selectable dialects, in the local runtime and in bubblewrap with no network but the gateway."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar.harness import HarnessContext, get_harness
from polar.harness.presets import pi
from polar.rollout.protocol import SessionStatus
from polar.runtime import RuntimeSpec, make_runtime
from polar.runtime.base import RuntimeFailure
from polar.store.records import CompletionRecord
from tests import extension_support as ext
from tests.preset_run_support import (
    check_run,
    jsonl_lines,
    needs_bwrap,
    needs_npm,
    needs_strace,
    run_cli,
    streamed,
    tool_script,
    traced_against_gateway,
)

# Pi 0.73.1's tools are read, bash, edit and write; bash takes {"command": ...}.
TOOL = "bash"
ARGS = '{"command":"printf \'hello from pi\\\\n\' > hello.txt"}'
EXPECT = "'hello from pi\\n'"
ROUTES = {
    "chat": {"/v1/chat/completions"},
    "responses": {"/v1/responses"},
    "anthropic": {"/v1/messages"},
    "gemini": {"/v1beta/models/fake-policy:streamGenerateContent"},
}


def ctx(tmp_path: Path, **kw: object) -> HarnessContext:
    fields: dict[str, object] = {
        "session_id": "sess-x",
        "gateway_url": "http://127.0.0.1:9999/",
        "model": "org/served:model",
        "instruction": "@file -x",
        "home": str(tmp_path / "home"),
        "workdir": str(tmp_path / "work"),
        "artifacts": str(tmp_path / "art"),
    }
    return HarnessContext(**{**fields, **kw})  # type: ignore[arg-type]


@pytest.mark.cli
@needs_npm
@pytest.mark.parametrize("dialect", list(pi.APIS))
@pytest.mark.parametrize("backend", ["local", pytest.param("bwrap", marks=needs_bwrap)])
async def test_pi_writes_the_file_in_each_dialect(tmp_path: Path, backend: str, dialect: str) -> None:
    settings = {} if dialect == "chat" else {"dialect": dialect}  # chat is the default
    run = await run_cli(tmp_path, "pi", TOOL, ARGS, EXPECT, settings=settings, backend=backend)
    check_run(run, dialect=dialect, tool=TOOL, paths=ROUTES[dialect])
    assert all(streamed(r, run.seen) for r in run.records)
    assert all(r.model_requested == "fake-policy" for r in run.records)
    # The key is the session id, sent in each dialect's own header.
    header = {"anthropic": "x-api-key", "gemini": "x-goog-api-key"}.get(dialect, "authorization")
    for s in (s for s in run.seen if s.method == "POST"):
        assert s.headers[header].removeprefix("Bearer ") == "sess-cli", s.headers
    # Pi re-serializes the call it sends back; the policy's arguments survive as the same JSON value.
    call = run.records[-1].upstream_request["messages"][-2]["tool_calls"][0]["function"]
    assert call["name"] == TOOL and call["arguments"] == ARGS
    # Its own transcript is in the artifacts, with the tool's result.
    entries = jsonl_lines(run.artifacts / pi.SESSIONS)
    assert any(e.get("message", {}).get("role") == "toolResult" for e in entries), entries[-3:]
    assert run.result.metadata["harness"] == {"transcripts": 1, "dialect": dialect}


@pytest.mark.cli
@needs_npm
async def test_compaction_is_a_tagged_side_call(tmp_path: Path) -> None:
    """A context window smaller than Pi's reserve (16384) makes Pi 0.73.1 compact after the run: a call
    with its summarization prompt and no tools, tagged, and a trace of its own beside the main loop's."""
    settings = {"context_window": 8000}
    run = await run_cli(tmp_path, "pi", TOOL, ARGS, EXPECT, settings=settings)
    traj = check_run(run, dialect="chat", tool=TOOL, paths=ROUTES["chat"])
    tags = [run.preset.classify(r) for r in run.records]
    assert tags == [(), (), ("side_call", "compaction")]
    side = run.records[-1]
    assert side.tools is None and side.trainable
    assert len(traj.traces) == 2 and traj.traces[1].metadata["completion_ids"] == [side.completion_id]


THINKS = {
    "chat": ("reasoning_effort", "high"),
    "responses": ("reasoning", {"effort": "high", "summary": "auto"}),
    "anthropic": ("thinking", {"type": "enabled", "budget_tokens": 15360, "display": "summarized"}),
}


@pytest.mark.cli
@needs_npm
@pytest.mark.parametrize("dialect", list(pi.APIS))
async def test_thinking_round_trips_in_each_dialect(tmp_path: Path, dialect: str) -> None:
    """With `thinking`, Pi 0.73.1 asks for reasoning in the dialect's own words and sends the policy's
    reasoning back (a thinking block, a reasoning item, a thought part), which reaches the policy as it was."""
    settings = {"dialect": dialect, "thinking": "high"}
    run = await run_cli(tmp_path, "pi", TOOL, ARGS, EXPECT, settings=settings, reasoning="Plan: use printf.")
    check_run(run, dialect=dialect, tool=TOOL, paths=ROUTES[dialect])
    first = run.records[0].request
    if dialect == "gemini":
        assert first["generationConfig"]["thinkingConfig"]["includeThoughts"] is True
    else:
        key, value = THINKS[dialect]
        assert first[key] == value
    history = run.records[1].upstream_request["messages"]
    (assistant,) = [m for m in history if m["role"] == "assistant"]
    assert assistant["reasoning_content"] == "Plan: use printf."


@pytest.mark.cli
@needs_npm
@pytest.mark.parametrize("dialect", list(pi.APIS))
async def test_a_failing_policy_server_ends_the_session_as_error(tmp_path: Path, dialect: str) -> None:
    """When every model call fails upstream, Pi must see the failure in its dialect and exit non-zero, so the
    node ends the session ERROR (masked), never as a zero-reward sample."""
    settings = {"dialect": dialect, "max_retries": 0}
    run = await run_cli(tmp_path, "pi", TOOL, ARGS, EXPECT, settings=settings, backend_status=503)
    assert run.records == []
    assert run.result.status == SessionStatus.ERROR, (run.result.status, run.result.reason)
    assert "inference backend failed" in (run.result.reason or "")


@pytest.mark.cli
@needs_npm
@needs_strace
@pytest.mark.parametrize("dialect", list(pi.APIS))
async def test_no_connection_but_the_gateway(tmp_path: Path, dialect: str) -> None:
    """Every socket Pi opens (DNS included) goes to the gateway, in each dialect. (Pi 0.73.1 in -p mode made
    no other connection even without PI_OFFLINE here; the switch guards its startup checks.)"""
    script = tool_script(TOOL, ARGS)
    result, addresses, port = await traced_against_gateway(tmp_path, "pi", script, {"dialect": dialect})
    assert result.exit_code == 0, result.stderr[-2000:]
    assert addresses == {("127.0.0.1", port)}


def test_models_json_per_dialect(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    expected = {
        "chat": ("openai-completions", "http://127.0.0.1:9999/v1"),
        "responses": ("openai-responses", "http://127.0.0.1:9999/v1"),
        "anthropic": ("anthropic-messages", "http://127.0.0.1:9999"),
        "gemini": ("google-generative-ai", "http://127.0.0.1:9999/v1beta"),
    }
    for dialect, (api, base) in expected.items():
        harness = pi.PiHarness({"dialect": dialect, "context_window": 8192, "max_tokens": 512})
        provider = harness.models_json(c)["providers"]["polar"]
        assert provider == {
            "baseUrl": base,
            "api": api,
            "apiKey": "POLAR_SESSION_ID",
            "models": [{"id": "org/served:model", "contextWindow": 8192, "maxTokens": 512}],
        }
    assert pi.PiHarness({}).dialect == "chat"


def test_command_and_env(tmp_path: Path) -> None:
    c = ctx(tmp_path, env={"PI_OFFLINE": "0"})
    harness = get_harness("pi", {"binary": "/opt/pi"})
    command = harness.command(c)
    assert isinstance(command, str)
    assert command.startswith("/opt/pi --provider polar --model org/served:model --session-dir ")
    assert command.endswith(f" -p < {tmp_path}/home/.polar/instruction.md")  # "@file -x" stays text
    env = harness.env(c)
    assert env["PI_CODING_AGENT_DIR"] == f"{tmp_path}/home/.pi/agent"
    assert env["POLAR_SESSION_ID"] == "sess-x" and env["PI_SKIP_VERSION_CHECK"] == "1"
    assert env["PI_OFFLINE"] == "0"  # the task's own env wins
    with pytest.raises(RuntimeError, match="before setup"):
        get_harness("pi").command(c)
    thinking = pi.PiHarness({"binary": "/opt/pi", "thinking": "low"})
    assert " --thinking low -p < " in thinking.command(c)
    assert thinking.models_json(c)["providers"]["polar"]["models"] == [
        {"id": "org/served:model", "reasoning": True}
    ]


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"dialect": "openai"}, "settings.dialect"),
        ({"binary": 3}, "settings.binary"),
        ({"context_window": -1}, "settings.context_window"),
        ({"max_tokens": "9"}, "settings.max_tokens"),
        ({"thinking": "max"}, "settings.thinking"),
        ({"reasoning": True}, "unknown settings"),
    ],
)
def test_bad_settings_are_refused_by_name(settings: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        get_harness("pi", settings)


def _record(tools: list[dict[str, object]] | None, system: str) -> CompletionRecord:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    return CompletionRecord(
        "s", 0, "c", "anthropic", 0.0, {}, {"messages": messages}, [1], [2], [-0.1], "stop",
        {"role": "assistant", "content": "x"}, tools, {}, "m", "m",
    )  # fmt: skip


def test_classify_tags_compaction_and_tool_less_calls() -> None:
    harness = get_harness("pi")
    tool = [{"type": "function", "function": {"name": TOOL, "parameters": {}}}]
    assert harness.classify(_record(tool, "You are an expert coding assistant")) == ()
    assert harness.classify(_record(None, "You are an expert coding assistant")) == ("side_call",)
    summary = "You are a context summarization assistant. Your task is to read a conversation"
    assert harness.classify(_record(None, summary)) == ("side_call", "compaction")


async def test_setup_that_cannot_write_fails_naming_the_file(tmp_path: Path) -> None:
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path / "rt"), "pi-setup")
    await runtime.start()
    try:
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("a file where the home should be")
        bad = ctx(tmp_path, home=str(blocker / "home"))
        with pytest.raises(RuntimeFailure, match=r"could not write .*[.]pi/agent/models[.]json"):
            await get_harness("pi", {"binary": "/opt/pi"}).setup(runtime, bad)
        # A run that left no transcript (the CLI never started) is reported as such, not as an error.
        meta = await get_harness("pi", {"binary": "/opt/pi"}).post_run(runtime, ctx(tmp_path))
        assert meta["transcripts"] == 0
    finally:
        await runtime.stop()


@pytest.mark.cli
@pytest.mark.containers
async def test_an_image_without_node_fails_setup_naming_what_is_missing(
    tmp_path: Path, docker_engine: str
) -> None:
    """Pi's npm entry point is a node script: in an image without Node.js the session ends at setup with
    the reason, instead of a harness exiting 127 on `env: node: No such file or directory`."""
    from tests.container_support import base_image

    run = await run_cli(tmp_path, "pi", TOOL, ARGS, EXPECT, backend="docker", image=base_image(docker_engine))
    assert run.result.status == SessionStatus.ERROR
    assert "harness setup failed" in (run.result.reason or "") and "no `node`" in (run.result.reason or "")
    assert run.records == []


@pytest.mark.cli
@needs_npm
async def test_gemini_calls_without_ids_get_the_policys_arguments_back(tmp_path: Path) -> None:
    """Pi 0.73.1's Gemini dialect sends each function call back as an object and without the id it was
    given: the gateway re-serializes it (compact) and names it by position. Matched by tool and value, the
    text the policy wrote (spaced) is put back, so the main loop is one chain with no drift."""
    spaced = '{"command": "printf \'hello from pi\\\\n\' > hello.txt"}'
    run = await run_cli(tmp_path, "pi", TOOL, spaced, EXPECT, settings={"dialect": "gemini"})
    traj = check_run(run, dialect="gemini", tool=TOOL, paths=ROUTES["gemini"])
    sent = run.records[-1].request["contents"]
    calls = [p["functionCall"] for c in sent for p in c.get("parts", []) if "functionCall" in p]
    assert calls and all("id" not in fc for fc in calls)  # the id the gateway gave is gone
    call = run.records[-1].upstream_request["messages"][-2]["tool_calls"][0]["function"]
    assert call["arguments"] == spaced
    assert len(traj.traces) == 1 and not traj.traces[0].metadata["drift_turns"]


@pytest.mark.cli
@needs_npm
async def test_pi_reads_the_tasks_skill(tmp_path: Path) -> None:
    """`agent.skills` in Pi's agent dir: the skill's description is in the system prompt of Pi's first call.
    (Pi has no MCP client: `agent.mcp_servers` is refused, tests/test_harness_extensions.py.)"""
    run = await run_cli(tmp_path, "pi", TOOL, ARGS, EXPECT, agent=ext.agent_fields(mcp=False))
    check_run(run, dialect="chat", tool=TOOL, paths=ROUTES["chat"])
    system = run.records[0].upstream_request["messages"][0]
    assert system["role"] == "system" and ext.SKILL_MARK in json.dumps(system["content"])
