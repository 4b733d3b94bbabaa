"""Gemini CLI 0.61.0 (the pinned npm package, unmodified) on a real node against the gateway's Gemini API.

The fake vLLM plays the model and makes the CLI call its own `run_shell_command` tool to write hello.txt,
then answers. Run in the `local` runtime (through a route recorder, to see the stream route the CLI chose)
and in `bwrap` with only the gateway reachable (the proof that it needs no other connection).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from polar.harness import HarnessContext, cli_common, get_harness
from polar.harness.presets import gemini_cli
from polar.runtime import RuntimeSpec, make_runtime
from polar.runtime.base import RuntimeFailure
from polar.store.records import CompletionRecord
from tests import extension_support as ext
from tests import mcp_weather
from tests.fakes.fake_vllm import Reply
from tests.preset_run_support import (
    SIDE_ANSWER,
    captured_record,
    check_capture,
    needs_bwrap,
    needs_strace,
    offered_tool_script,
    run_preset,
    traced_against_gateway,
)

pytestmark = pytest.mark.cli

CONTENT = "hello from gemini"
# Compact JSON: the CLI re-serializes arguments when it replays history.
WRITE = '{"command":"printf \'hello from gemini\' > hello.txt"}'


def _gemini_tools(record: CompletionRecord) -> list[str]:
    return [d["name"] for t in record.request.get("tools", []) for d in t.get("functionDeclarations", [])]


async def test_gemini_cli_local_streams_and_captures_one_trace(tmp_path: Path) -> None:
    run = await run_preset(
        tmp_path, "gemini_cli", {}, offered_tool_script("run_shell_command", WRITE, "Done."), expect=CONTENT
    )
    main = check_capture(run, "gemini_cli", {}, "gemini")
    assert len(main) == len(run.records) == 2  # no router, no side call: `-m` and the settings hold
    assert {r.model_requested for r in run.records} == {"fake-policy"}
    assert "run_shell_command" in _gemini_tools(main[0])
    # Streaming in its own dialect: Gemini says so in the path (the body has no `stream` key).
    # Nothing else reached the gateway either (no model listing, no countTokens).
    stream = ("POST", "/v1beta/models/fake-policy:streamGenerateContent", "alt=sse")
    assert run.routes == [stream] * 2, run.routes
    # The CLI echoed the gateway's call id and answered with a functionResponse.
    replay = main[1].request["contents"]
    call = next(p["functionCall"] for c in replay for p in c["parts"] if "functionCall" in p)
    answer = next(p["functionResponse"] for c in replay for p in c["parts"] if "functionResponse" in p)
    assert call["id"] == answer["id"] == main[0].response_message["tool_calls"][0]["id"]
    # Its own session transcript is in the artifacts.
    assert run.result.metadata["harness"]["transcript_files"] >= 1
    chats = list((run.artifacts / "gemini").rglob("chats/*.jsonl"))
    assert chats and CONTENT in chats[0].read_text()


@needs_bwrap
async def test_gemini_cli_in_bwrap_reaches_only_the_gateway(tmp_path: Path) -> None:
    run = await run_preset(
        tmp_path,
        "gemini_cli",
        {},
        offered_tool_script("run_shell_command", WRITE, "Done."),
        expect=CONTENT,
        backend="bwrap",
    )
    main = check_capture(run, "gemini_cli", {}, "gemini")
    assert len(main) == 2


async def test_gemini_cli_side_call_goes_to_the_served_model_and_is_tagged(tmp_path: Path) -> None:
    """A tool-output summarizer (0.61.0's `summarizer-shell` alias, normally `gemini-3.5-flash-lite`) runs
    when the task enables it: it must ask for the served model and be tagged a side call."""
    write = json.dumps(
        {"command": "seq 1 1000; printf 'hello from gemini' > hello.txt"}, separators=(",", ":")
    )
    settings: dict[str, Any] = {"config": {"model": {"summarizeToolOutput": {"run_shell_command": {}}}}}
    run = await run_preset(
        tmp_path,
        "gemini_cli",
        settings,
        offered_tool_script("run_shell_command", write, "Done."),
        expect=CONTENT,
    )
    main = check_capture(run, "gemini_cli", settings, "gemini")
    harness = get_harness("gemini_cli", settings)
    tags = [harness.classify(r) for r in run.records]
    assert tags == [(), ("side_call", "summarizer"), ()]
    assert len(main) == 2
    assert {r.model_requested for r in run.records} == {"fake-policy"}
    assert run.records[1].response_message["content"] == SIDE_ANSWER


@needs_strace
async def test_gemini_cli_connects_to_nothing_but_the_gateway(tmp_path: Path) -> None:
    """Not just "works without a network" (bwrap): every internet socket the CLI and its children open, even
    a failed attempt (DNS, telemetry, update check), goes to the gateway."""
    result, connections, port = await traced_against_gateway(
        tmp_path, "gemini_cli", offered_tool_script("run_shell_command", WRITE, "Done.")
    )
    assert result.exit_code == 0, result.stderr[-2000:]
    assert connections and set(connections) == {("127.0.0.1", port)}, connections


async def test_gemini_cli_resends_an_empty_answer(tmp_path: Path) -> None:
    """LIMITS: 0.61.0 treats an answer with no text as invalid and resends the request with a nudge appended
    to the last user turn, three times; every attempt is captured."""
    run = await run_preset(tmp_path, "gemini_cli", {}, lambda body: Reply(content=""), expect=None)
    assert run.result.reason is None  # it still exits 0
    assert len(run.records) == len(run.fake.requests) == 4
    first, *retries = (r.request["contents"] for r in run.records)
    for contents in retries:
        assert contents[:-1] == first[:-1] and contents[-1]["parts"][:-1] == first[-1]["parts"]
        assert "You previously returned an empty response" in contents[-1]["parts"][-1]["text"]


def _record(request: dict[str, Any], tools: bool) -> CompletionRecord:
    return captured_record("gemini", request, tools=tools)


def test_classify_main_loop_subagent_and_unknown_side_call() -> None:
    harness = get_harness("gemini_cli")
    main = {"systemInstruction": {"parts": [{"text": gemini_cli.MAIN_PROMPT + " specializing in ..."}]}}
    sub = {"systemInstruction": {"parts": [{"text": "You are Codebase Investigator, ..."}]}}
    other = {"contents": [{"role": "user", "parts": [{"text": "Is this a loop?"}]}]}
    assert harness.classify(_record(main, tools=True)) == ()
    assert harness.classify(_record(sub, tools=True)) == ("subagent",)
    assert harness.classify(_record(other, tools=False)) == ("side_call", "no_tools")


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"extra_args": "--debug"}, "settings.extra_args"),
        ({"extra_args": [1]}, "settings.extra_args"),
        ({"config": []}, "settings.config"),
        ({"model": "x"}, "unknown settings ['model']"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=r"gemini_cli harness: .*") as err:
        get_harness("gemini_cli", settings)
    assert field in str(err.value)


def test_command_and_env_point_at_the_session() -> None:
    harness = gemini_cli.GeminiCliHarness({"extra_args": ["--debug"]})
    ctx = HarnessContext("sid-1", "http://127.0.0.1:9", "served", "do it", "/h", "/w", "/a", env={"X": "1"})
    with pytest.raises(RuntimeError, match="before setup"):
        harness.command(ctx)
    harness.binary = Path("/tools/gemini")
    assert harness.command(ctx) == ["/tools/gemini", "-m", "served", "--yolo", "--debug", "-p", "do it"]
    env = harness.env(ctx)
    assert env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:9" and env["GEMINI_API_KEY"] == "sid-1"
    assert env["GEMINI_CLI_TRUST_WORKSPACE"] == "true" and env["X"] == "1" and env["HOME"] == "/h"
    config = cli_common.deep_merge(gemini_cli.cli_settings("served"), {"privacy": {"extra": 1}})
    assert config["privacy"] == {"usageStatisticsEnabled": False, "extra": 1}
    overrides = config["modelConfigs"]["customOverrides"]
    assert {o["match"]["model"] for o in overrides} >= {"base", "chat-compression-default"}
    assert {o["modelConfig"]["model"] for o in overrides} == {"served"}


async def test_setup_and_post_run_failures_are_clear(tmp_path: Path) -> None:
    """A home the runtime cannot write fails setup naming the file; a run that left no home collects nothing
    and says why (the node records post-run metadata, it does not fail the session)."""
    runtime = make_runtime(RuntimeSpec(backend="local", root=tmp_path), "failing")
    await runtime.start()
    try:
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("a file where the home should be")
        ctx = HarnessContext(
            "sid", "http://127.0.0.1:9", "m", "x", str(blocker), str(tmp_path), str(tmp_path / "a")
        )
        harness = gemini_cli.GeminiCliHarness()
        with pytest.raises(RuntimeFailure, match=r"could not write .*not-a-dir/\.gemini/settings\.json"):
            await harness.setup(runtime, ctx)
        gone = dataclasses.replace(ctx, home=str(tmp_path / "missing"))
        meta = await harness.post_run(runtime, gone)
        assert meta["transcript_files"] == 0 and "missing" in meta["collect_error"]
    finally:
        await runtime.stop()


async def test_gemini_cli_runs_the_tasks_mcp_server_and_reads_its_skill(tmp_path: Path) -> None:
    """`agent.mcp_servers` and `agent.skills`: the policy calls `mcp_weather_forecast` (0.61.0's name for the
    server's tool) and the forecast comes back in the next request. 0.61.0 waits for its servers before the
    first call (the server starts 3 s late here) and lists the skill in its system instruction."""
    await asyncio.to_thread(mcp_weather.install)
    run = await run_preset(
        tmp_path,
        "gemini_cli",
        {},
        ext.weather_script("mcp_weather_forecast"),
        expect=None,
        agent=ext.agent_fields(delay_s=3),
    )
    ext.check_weather_run(run, "gemini_cli", "gemini", "mcp_weather_forecast")
