"""The `shell` and `builtin` presets run through a real LocalRuntime against a real gateway.

What a node does with a harness: setup, exec(command, env) in the runtime, post_run. The fake vLLM plays the
model; everything else (the agent, bash, the files, the gateway, the SQLite store) is real.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from polar.harness import HarnessContext, get_harness
from polar.runtime import LocalRuntime, RuntimeSpec, make_runtime
from polar.trajectory import audit, build
from tests.conftest import FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply

pytestmark = pytest.mark.shared_stack

HELLO = "hello from the preset\n"
SCRIPT = [
    Reply(
        content="Writing.", tool_calls=[("write_file", json.dumps({"path": "hello.txt", "content": HELLO}))]
    ),
    Reply(tool_calls=[("bash", '{"command": "cat hello.txt"}')]),
    Reply(content="Done.", tool_calls=[("finish", '{"summary": "hello.txt is there"}')]),
]
# Everything a shell would otherwise interpret: quotes, substitutions, globs, separators, newlines and a
# placeholder that must not be substituted a second time.
NASTY = 'it\'s "quoted" $(touch pwned) `touch pwned2` $HOME * ; rm -rf / & {workdir}\n  second line\\n\n'


@pytest.fixture
async def rt(tmp_path: Path, gateway: Gateway) -> AsyncIterator[LocalRuntime]:
    """A sandbox (the default runtime) whose network reaches only the gateway, at `rt.gateway_url`."""
    runtime = make_runtime(RuntimeSpec(root=tmp_path), "preset-session", gateway_url=gateway.url)
    assert isinstance(runtime, LocalRuntime) and runtime.gateway_url is not None
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


def context(rt: LocalRuntime, sid: str, gw_url: str, instruction: str, **env: str) -> HarnessContext:
    return HarnessContext(
        session_id=sid,
        gateway_url=gw_url,
        model="preset-model",
        instruction=instruction,
        home=rt.runtime_path(rt.home),
        workdir=rt.runtime_path(rt.workdir),
        artifacts=rt.runtime_path(rt.artifacts),
        env=env,
    )


async def run_harness(name: str, settings: dict[str, Any], rt: LocalRuntime, ctx: HarnessContext) -> Any:
    harness = get_harness(name, settings)
    await harness.setup(rt, ctx)
    result = await rt.exec(harness.command(ctx), env=harness.env(ctx), timeout_s=120)
    return harness, result, await harness.post_run(rt, ctx)


@pytest.mark.parametrize("stream", [False, True])
async def test_builtin_preset_end_to_end(
    rt: LocalRuntime, gateway: Gateway, fake_backend: FakeBackend, stream: bool
) -> None:
    fake_backend.app.reset(SCRIPT)
    sid = gateway.new_session()
    ctx = context(rt, sid, str(rt.gateway_url), "Create hello.txt and show it.")
    settings = {"max_turns": 5, "stream": stream}
    _, result, meta = await run_harness("builtin", settings, rt, ctx)
    assert result.exit_code == 0, result.stderr
    assert (rt.workdir / "hello.txt").read_text() == HELLO
    assert meta == {"finished": True, "turns": 3, "stop_reason": "finish", "summary": "hello.txt is there"}
    assert (rt.home / ".polar" / "instruction.md").read_text() == "Create hello.txt and show it."

    transcript = [json.loads(line) for line in (rt.artifacts / "transcript.jsonl").read_text().splitlines()]
    assert transcript[0]["instruction"] == "Create hello.txt and show it."
    assert [e["output"] for e in transcript if e["type"] == "tool"][1] == f"exit code: 0\n{HELLO}"

    records = gateway.completions(sid)
    assert len(records) == 3 and all(r.prompt_ids and r.response_ids for r in records)
    assert {r.model_requested for r in records} == {"preset-model"}
    trajectory = build(records, strategy="prefix_merging")
    report = audit(trajectory, records)
    assert len(trajectory.traces) == 1 and report.ok, report.errors
    assert report.trainable_tokens == sum(len(r.response_ids or []) for r in records)
    assert len(trajectory.traces[0].response_ids) > report.trainable_tokens  # the tool outputs, masked


async def test_builtin_preset_reports_api_errors_and_missing_transcripts(
    rt: LocalRuntime, gateway: Gateway, fake_backend: FakeBackend
) -> None:
    fake_backend.app.reset(SCRIPT)
    harness = get_harness("builtin", {"max_retries": 0})
    ctx = context(rt, "no-such-session", str(rt.gateway_url), "x")
    assert await harness.post_run(rt, ctx) == {"finished": False, "turns": 0, "stop_reason": "no_transcript"}
    _, result, meta = await run_harness("builtin", {"max_retries": 0}, rt, ctx)
    assert result.exit_code == 2 and "model API error on turn 1" in result.stderr and "401" in result.stderr
    assert meta["stop_reason"] == "api_error" and not meta["finished"] and "401" in meta["error"]


async def test_shell_preset_passes_the_instruction_literally(rt: LocalRuntime) -> None:
    ctx = context(rt, "s", "http://127.0.0.1:9", NASTY, OPENAI_MODEL="from-task-env")
    command = (
        "printf '%s' {instruction} > out.txt; cp {instruction_file} copy.txt; "
        "printf %s \"$OPENAI_BASE_URL ${OPENAI_MODEL}\" > env.txt; awk '{print $1}' out.txt | head -1 > awk.txt"
    )
    _, result, meta = await run_harness("shell", {"command": command}, rt, ctx)
    assert result.exit_code == 0, result.stderr
    assert (rt.workdir / "out.txt").read_text() == NASTY
    assert (rt.workdir / "copy.txt").read_text() == NASTY
    assert not (rt.workdir / "pwned").exists() and not (rt.workdir / "pwned2").exists()
    assert (rt.workdir / "env.txt").read_text() == "http://127.0.0.1:9/v1 from-task-env"
    assert (rt.workdir / "awk.txt").read_text() == "it's\n"  # other braces are the shell's
    assert meta == {}  # nothing collected by default


async def test_shell_preset_collects_requested_paths(rt: LocalRuntime) -> None:
    ctx = context(rt, "s", "http://127.0.0.1:9", "log it")
    settings = {
        "command": "mkdir -p logs && echo {instruction} > logs/run.log",
        "collect": ["logs", "nope.txt"],
    }
    _, result, meta = await run_harness("shell", settings, rt, ctx)
    assert result.exit_code == 0, result.stderr
    assert meta == {"collected": ["logs"], "missing": ["nope.txt"]}
    assert (rt.artifacts / "logs" / "run.log").read_text() == "log it\n"


async def test_shell_preset_runs_an_agent_against_the_gateway(
    rt: LocalRuntime, gateway: Gateway, fake_backend: FakeBackend
) -> None:
    """Any program that reads the standard variables is captured: here the reference agent, as a command."""
    fake_backend.app.reset(SCRIPT)
    sid = gateway.new_session()
    ctx = context(rt, sid, str(rt.gateway_url), "Create hello.txt.")
    command = (
        f"{shlex.quote(sys.executable)} -m polar.harness.agent --instruction-file {{instruction_file}} "
        "--workdir {workdir} --transcript {artifacts}/agent.jsonl"
    )
    _, result, _ = await run_harness("shell", {"command": command}, rt, ctx)
    assert result.exit_code == 0, result.stderr
    assert (rt.workdir / "hello.txt").read_text() == HELLO
    assert len(gateway.completions(sid)) == 3
