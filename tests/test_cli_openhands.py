"""The `openhands` preset runs the real OpenHands CLI (PyPI `openhands`, pinned) on a node.

OpenHands 1.16.0 runs on Python 3.12 only: the tests find one on this machine as the preset does (pyenv's
3.12 here) and are skipped where there is none. The fake vLLM plays the model: it calls OpenHands' `terminal`
tool (with the `security_risk` argument OpenHands requires) to write hello.txt and a line telling whether
LD_LIBRARY_PATH reached the agent's shell, then answers without a tool call, which ends the headless run.
Other scripts delegate the file to a sub-agent through the `task` tool, or take enough steps for the
condenser to summarise. The gateway, the runtime (local, and bwrap with only the gateway reachable),
OpenHands with its SDK and LiteLLM, and the store are real.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from polar.harness.base import HarnessContext
from polar.harness.install import InstallError, find_python
from polar.harness.presets import openhands
from polar.harness.registry import get_harness
from polar.rollout.protocol import SessionStatus
from polar.trajectory import audit, build
from tests import extension_support as ext
from tests import mcp_weather
from tests.fakes.fake_vllm import Reply
from tests.preset_run_support import (
    INSTRUCTION,
    PresetRun,
    captured_record,
    check_capture,
    needs_bwrap,
    needs_strace,
    run_preset,
    traced_against_gateway,
)

# hello.txt, and whether the copy's libpython folder leaked into the agent's shell (it must not).
WRITE = "printf 'hello from openhands\\n' > hello.txt && echo LD_LIBRARY_PATH=${LD_LIBRARY_PATH-unset} >> hello.txt"
EXPECT = "hello from openhands\nLD_LIBRARY_PATH=unset\n"
DELEGATE = "Have a sub-agent create the file hello.txt."
DONE = "Done: hello.txt is written."


@pytest.fixture(scope="module")
def python312() -> Path:
    """The Python 3.12 the preset will copy (once, into the tool cache the first run installs)."""
    try:
        return find_python(openhands.PYTHON)
    except InstallError as exc:
        pytest.skip(f"OpenHands 1.16.0 needs Python 3.12: {exc}")


def terminal(command: str) -> tuple[str, str]:
    return ("terminal", json.dumps({"command": command, "security_risk": "LOW"}))


def tool_names(body: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in body.get("tools") or []]


def answered(body: dict[str, Any]) -> int:
    return sum(m.get("role") == "tool" for m in body["messages"])


def script(body: dict[str, Any]) -> Reply:
    """The main loop and a sub-agent alike: write the file, then answer. A delegating task has the main
    loop hand the file to a sub-agent (the `task` tool) instead; a summary request gets a summary."""
    assert body.get("stream") is not True  # OpenHands' CLI never streams
    names = tool_names(body)
    if not names:
        return Reply(content="USER_CONTEXT: create hello.txt")  # the condenser
    first = json.dumps(body["messages"][1]["content"])
    if openhands.TASK_TOOL in names and DELEGATE in first:
        if answered(body):
            return Reply(content=DONE)
        prompt = {
            "prompt": "Create the file hello.txt.",
            "description": "write hello",
            "security_risk": "LOW",
        }
        return Reply(content="Delegating.", tool_calls=[(openhands.TASK_TOOL, json.dumps(prompt))])
    if answered(body):
        return Reply(content=DONE)
    return Reply(content="Writing hello.txt.", tool_calls=[terminal(WRITE)])


def stepping(steps: int) -> Callable[[dict[str, Any]], Reply]:
    """The main loop runs `steps` commands, then writes the file, then answers; the policy counts its own
    calls (the condenser replaces the history it could count from). Each summary is a different text."""
    calls: list[int] = []
    summaries: list[int] = []

    def step(body: dict[str, Any]) -> Reply:
        if not tool_names(body):
            summaries.append(1)
            return Reply(content=f"USER_CONTEXT: create hello.txt (summary {len(summaries)})")
        calls.append(1)
        k = len(calls) - 1
        if k < steps:
            return Reply(content=f"Step {k}.", tool_calls=[terminal(f"echo step {k}")])
        if k == steps:
            return Reply(content="Writing hello.txt.", tool_calls=[terminal(WRITE)])
        return Reply(content=DONE)

    return step


def first_user_text(run: PresetRun) -> str:
    messages = run.records[0].request["messages"]
    (user,) = [m for m in messages if m["role"] == "user"]
    return "".join(p["text"] for p in user["content"])


def check_run(run: PresetRun, settings: dict[str, Any], **capture: Any) -> list[Any]:
    main = check_capture(run, "openhands", settings, "chat", **capture)
    assert {s.path for s in run.seen} <= {"/v1/chat/completions"}  # nothing else asked of the gateway
    assert {r.model_requested for r in run.records} == {"fake-policy"}  # openai/<M>, the prefix stripped
    assert run.result.metadata["harness"] == {"conversations": 1}
    events = list((run.artifacts / openhands.CONVERSATIONS).glob("*/events/event-*.json"))
    assert events  # OpenHands' own transcript, in the artifacts
    return main


@pytest.mark.cli
async def test_openhands_local(tmp_path: Path, python312: Path) -> None:
    run = await run_preset(tmp_path, "openhands", {}, script, expect=EXPECT, instruction=INSTRUCTION)
    main = check_run(run, {})
    assert len(main) == len(run.records) == 2  # the terminal call and the answer: one trace, no side calls
    assert first_user_text(run) == INSTRUCTION  # verbatim: a leading "-" is no flag, no file preamble
    tools = {t["function"]["name"] for t in main[0].tools or []}
    assert tools == {"terminal", "file_editor", "task_tracker", "task", "finish", "think"}  # no browser


@pytest.mark.cli
@needs_bwrap
async def test_openhands_subagent_in_bwrap(tmp_path: Path, python312: Path) -> None:
    """In the sandbox: the main loop hands the file to a sub-agent (the `task` tool); the sub-agent's calls
    reach the gateway with the agent's model and are tagged `subagent`; the main loop stays one trace."""
    run = await run_preset(
        tmp_path, "openhands", {}, script, expect=EXPECT, backend="bwrap", instruction=DELEGATE
    )
    main = check_run(run, {}, allow_subagents=True)
    tags = [run.preset.classify(r) for r in run.records]
    assert tags == [(), ("subagent",), ("subagent",), ()], tags
    assert main[0].response_message["tool_calls"][0]["function"]["name"] == openhands.TASK_TOOL


@pytest.mark.cli
async def test_openhands_condenses_with_a_tagged_side_call(tmp_path: Path, python312: Path) -> None:
    """With a small `condenser_max_size` OpenHands summarises its history: the summary is a tagged side
    call to the gateway, and the main loop's next call (the history replaced by the summary) starts a
    second trace, which the builder marks as started by a compaction."""
    settings = {"condenser_max_size": openhands.MIN_CONDENSER_SIZE}
    run = await run_preset(tmp_path, "openhands", settings, stepping(3), expect=EXPECT)
    assert run.result.status == SessionStatus.COMPLETED and run.result.reward == 1.0, run.result.metadata
    tags = [run.preset.classify(r) for r in run.records]
    assert tags == [(), (), (), (), ("side_call", "condenser"), ()], tags  # 3 steps, the write; then done
    condensation = run.records[4].request["messages"]
    assert len(condensation) == 1 and openhands.CONDENSER_PROMPT in json.dumps(condensation)
    main = [r for r, t in zip(run.records, tags, strict=True) if not t]
    trajectory = build(main, strategy="prefix_merging")
    assert [t.metadata["started_by"] for t in trajectory.traces] == ["root", "compaction"]
    assert audit(trajectory, main).ok
    assert "summary 1" in json.dumps(main[-1].request["messages"])  # the summary replaced the history


@pytest.mark.cli
async def test_settings_openhands_cannot_load_fail_the_session(tmp_path: Path, python312: Path) -> None:
    """OpenHands 1.16.0 exits 0 having done nothing when its agent settings do not load (here a
    temperature that is no number): the preset's post-run check makes that an error."""
    settings = {"llm": {"temperature": "hot"}}
    run = await run_preset(tmp_path, "openhands", settings, script, expect=None)
    assert run.result.status == SessionStatus.ERROR, run.result
    assert "OpenHands made no conversation" in (run.result.reason or "")
    assert run.records == []


@pytest.mark.cli
@needs_strace
async def test_openhands_reaches_only_the_gateway(tmp_path: Path, python312: Path) -> None:
    """Every connect/sendto of OpenHands and its children (git included), traced in a runtime where only
    the gateway answers: the gateway, and name lookups that go nowhere (its PyPI version check, which has
    no switch; the public-skills clone looks nothing up: git's environment sends its URL to a path)."""
    result, addresses, port = await traced_against_gateway(tmp_path, "openhands", script)
    assert result.exit_code == 0, result.stderr[-2000:]
    others = addresses - {("127.0.0.1", port)}
    assert ("127.0.0.1", port) in addresses
    assert all(p == 53 for _, p in others), others  # lookups only (which fail: no network but the gateway)
    assert "public-skills" in result.stdout + result.stderr  # the clone was tried, and failed at once


@pytest.mark.cli
async def test_openhands_runs_the_tasks_mcp_server_and_reads_its_skill(
    tmp_path: Path, python312: Path
) -> None:
    """`agent.mcp_servers` and `agent.skills`: the policy calls `forecast` (one server's tools keep their
    names) with the `security_risk` OpenHands asks of every tool not marked read-only, and the forecast
    comes back in the next request. OpenHands lists the server's tools before its first call (the server
    starts 3 s late here) and the skill's description is in the system prompt. The server runs with the
    task's LD_LIBRARY_PATH, not the copied Python's."""
    await asyncio.to_thread(mcp_weather.install)
    fields = ext.agent_fields(delay_s=3)
    dump = tmp_path / "mcp-env"
    weather = fields["mcp_servers"]["weather"]
    weather["args"][1] = f"env > {dump}; {weather['args'][1]}"
    fields["env"] = {"LD_LIBRARY_PATH": "/opt/task-lib"}
    arguments = '{"city":"Oslo","security_risk":"LOW"}'
    script = ext.weather_script("forecast", arguments)
    run = await run_preset(tmp_path, "openhands", {}, script, expect=None, agent=fields)
    main = ext.check_weather_run(run, "openhands", "chat", "forecast", arguments=arguments)
    assert "invoke_skill" in tool_names(main[0].request)
    env = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert env["LD_LIBRARY_PATH"] == "/opt/task-lib" and env["POLAR_HOME"]


@pytest.mark.cli
async def test_a_missing_mcp_server_program_ends_the_session_before_openhands_waits_for_it(
    tmp_path: Path, python312: Path
) -> None:
    """OpenHands 1.16.0 given a server whose command does not exist hangs before its first call until the
    session's deadline (measured); the node looks the program up first and ends the session at setup."""
    fields = ext.agent_fields()
    fields["mcp_servers"]["weather"] = {"command": "polar-no-such-mcp-server"}
    run = await run_preset(tmp_path, "openhands", {}, script, expect=None, agent=fields)
    assert run.result.status == SessionStatus.ERROR, run.result
    assert "weather ('polar-no-such-mcp-server' not found on PATH=" in (run.result.reason or "")
    assert run.records == []  # ERROR at setup, not TIMEOUT at the deadline: OpenHands never ran


def ctx(tmp_path: Path, env: dict[str, str] | None = None) -> HarnessContext:
    return HarnessContext(
        session_id="polar-key",
        gateway_url="http://127.0.0.1:8000/",
        model="m",
        instruction="-fix it; $(rm -rf /)",
        home=str(tmp_path / "home"),
        workdir=str(tmp_path / "w"),
        artifacts=str(tmp_path / "a"),
        env=env or {},
    )


def test_agent_settings_command_and_env(tmp_path: Path) -> None:
    harness = openhands.OpenHandsHarness({"condenser_max_size": 100, "llm": {"temperature": 0.5}})
    c = ctx(tmp_path, {"LD_LIBRARY_PATH": "/opt/lib", "EXTENSIONS_REF": "x"})
    agent = harness.agent_settings(c)
    condenser = agent["condenser"]
    for llm, usage in ((agent["llm"], "agent"), (condenser["llm"], "condenser")):
        assert llm["model"] == "openai/m" and llm["base_url"] == "http://127.0.0.1:8000/v1"
        assert llm["api_key"] == "polar-key" and llm["usage_id"] == usage and llm["temperature"] == 0.5
    assert condenser["kind"] == "LLMSummarizingCondenser" and condenser["max_size"] == 100
    command = harness.command(c)
    assert command[-1] == f"{tmp_path}/home/.polar/instruction.md"
    assert "-fix it" not in " ".join(command)  # the instruction is in a file, never an argument
    harness.prefix = tmp_path / "copy"  # as setup leaves it, for a copy holding a shared libpython
    (tmp_path / "copy" / "lib").mkdir(parents=True)
    (tmp_path / "copy" / "lib" / "libpython3.12.so.1.0").write_bytes(b"")
    env = harness.env(c)
    assert env["HOME"] == f"{tmp_path}/home"
    assert env["OPENHANDS_PERSISTENCE_DIR"] == f"{tmp_path}/home/.openhands"
    assert env["OPENHANDS_CONVERSATIONS_DIR"] == f"{tmp_path}/a/openhands-conversations"
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path}/copy/lib:/opt/lib"  # the copy's, then the task's
    assert env["LD_LIBRARY_PATH_ORIG"] == "/opt/lib"  # what the agent's shell gets back
    assert env["EXTENSIONS_REF"] == "x"  # the task's env comes through
    assert env["GIT_CONFIG_VALUE_0"] == openhands.PUBLIC_SKILLS


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"condenser": 10}, "unknown settings ['condenser']"),
        ({"python": "python3.12"}, "settings.python must be an absolute path"),
        ({"condenser_max_size": 7}, "settings.condenser_max_size must be at least 8"),
        ({"condenser_max_size": "big"}, "settings.condenser_max_size must be a positive integer"),
        ({"llm": ["temperature"]}, "settings.llm must be a mapping"),
        ({"llm": {"base_url": "http://elsewhere"}}, "may not set ['base_url']"),
    ],
)
def test_bad_settings_name_the_setting(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="openhands harness") as info:
        get_harness("openhands", settings)
    assert message in str(info.value)


def test_classify_tags_condenser_summaries_and_subagents() -> None:
    harness = openhands.OpenHandsHarness({})
    loop = {"messages": [{"role": "system", "content": "You are OpenHands agent"}], "tools": []}
    main = captured_record("chat", loop, tools=True)
    main = dataclasses.replace(main, tools=[{"type": "function", "function": {"name": "task"}}])
    assert harness.classify(main) == ()
    sub = dataclasses.replace(main, tools=[{"type": "function", "function": {"name": "terminal"}}])
    assert harness.classify(sub) == ("subagent",)
    summary = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": openhands.CONDENSER_PROMPT}]}]
    }
    assert harness.classify(captured_record("chat", summary, tools=False)) == ("side_call", "condenser")
