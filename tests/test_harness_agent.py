"""The built-in agent as a plain subprocess against a real gateway in front of the scripted fake vLLM.

The fake plays the model: it asks for `write_file`, then `bash cat`, then `finish`; the agent runs the tools
for real in a temp workdir. Every call must be captured with token ids, and `prefix_merging` must rebuild
the session as one trace whose sampled tokens are trainable and whose tool outputs are masked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from polar.harness import HarnessContext, gateway_env
from polar.harness.agent import EXIT_API_ERROR, EXIT_FINISHED, EXIT_MAX_TURNS, EXIT_USAGE
from polar.trajectory import audit, build
from tests.conftest import FakeBackend, Gateway
from tests.fakes.chatml import FakeTokenizer
from tests.fakes.fake_vllm import Reply

pytestmark = pytest.mark.shared_stack

HELLO = "hello from polar\n"
WRITE = ("write_file", json.dumps({"path": "hello.txt", "content": HELLO}))
CAT = ("bash", '{"command": "cat hello.txt"}')
FINISH = ("finish", '{"summary": "wrote hello.txt"}')


@dataclass
class AgentRun:
    proc: subprocess.CompletedProcess[str]
    workdir: Path
    transcript: list[dict[str, Any]]
    sid: str


def run_agent(
    gw: Gateway,
    fake: FakeBackend,
    tmp: Path,
    script: Sequence[Reply] | Any,
    *args: str,
    key: str | None = None,
    env: dict[str, str] | None = None,
) -> AgentRun:
    fake.app.reset(script)
    sid = gw.new_session()
    workdir, home = tmp / "work", tmp / "home"
    workdir.mkdir(parents=True)
    home.mkdir(parents=True)
    instruction = home / "instruction.md"
    instruction.write_text("Create hello.txt, show it, then finish.")
    transcript = tmp / "artifacts" / "transcript.jsonl"
    ctx = HarnessContext(
        session_id=key or sid,
        gateway_url=gw.url,
        model="polar-agent-model",
        instruction=instruction.read_text(),
        home=str(home),
        workdir=str(workdir),
        artifacts=str(transcript.parent),
    )
    full_env = {"PATH": os.environ["PATH"], **gateway_env(ctx), **(env or {})}
    argv = [sys.executable, "-m", "polar.harness.agent", "--instruction-file", str(instruction)]
    argv += ["--workdir", str(workdir), "--transcript", str(transcript), "--max-retries", "0", *args]
    proc = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=120)
    lines = transcript.read_text().splitlines() if transcript.exists() else []
    return AgentRun(proc, workdir, [json.loads(line) for line in lines], sid)


def tool_outputs(run: AgentRun) -> list[str]:
    return [e["output"] for e in run.transcript if e["type"] == "tool"]


@pytest.mark.parametrize("stream", [False, True])
def test_write_cat_finish_is_one_trace(
    gateway: Gateway, fake_backend: FakeBackend, tmp_path: Path, stream: bool
) -> None:
    script = [
        Reply(content="I will write the file.", reasoning="Start with the file.", tool_calls=[WRITE]),
        Reply(tool_calls=[CAT]),
        Reply(content="Done.", tool_calls=[FINISH]),
    ]
    run = run_agent(gateway, fake_backend, tmp_path, script, *(["--stream"] if stream else []))
    assert run.proc.returncode == EXIT_FINISHED, run.proc.stderr
    assert (run.workdir / "hello.txt").read_text() == HELLO

    kinds = [e["type"] for e in run.transcript]
    assert kinds == ["start", "assistant", "tool", "assistant", "tool", "assistant", "tool", "end"]
    assert tool_outputs(run) == [
        f"wrote {len(HELLO)} bytes to hello.txt",
        f"exit code: 0\n{HELLO}",
        "finished",
    ]
    end = run.transcript[-1]
    assert end == {
        "type": "end",
        "finished": True,
        "reason": "finish",
        "turns": 3,
        "summary": "wrote hello.txt",
    }
    assert run.transcript[1]["message"]["reasoning_content"] == "Start with the file."

    # The gateway captured every call with token ids, and the fake saw the tool results as tool messages.
    records = gateway.completions(run.sid)
    assert len(records) == 3 == len(fake_backend.app.requests)
    assert all(r.prompt_ids and r.response_ids and r.response_logprobs for r in records)
    assert all(r.model_requested == "polar-agent-model" for r in records)
    last = fake_backend.app.requests[-1]["messages"]
    assert [m["content"] for m in last if m["role"] == "tool"] == tool_outputs(run)[:2]

    trajectory = build(records, strategy="prefix_merging")
    assert len(trajectory.traces) == 1
    report = audit(trajectory, records)
    assert report.ok, report.errors
    trace = trajectory.traces[0]
    tok = FakeTokenizer()
    trained = [i for i, m in zip(trace.response_ids, trace.loss_mask, strict=True) if m]
    masked = tok.decode([i for i, m in zip(trace.response_ids, trace.loss_mask, strict=True) if not m])
    assert trained == [i for r in records for i in r.response_ids or []]
    assert f"wrote {len(HELLO)} bytes to hello.txt" in masked and f"exit code: 0\n{HELLO}" in masked
    assert "exit code: 0" not in tok.decode(trained)  # tool output never carries loss
    assert "write_file" in tok.decode(trained)


def test_bad_tool_arguments_are_answered_and_the_loop_goes_on(
    gateway: Gateway, fake_backend: FakeBackend, tmp_path: Path
) -> None:
    script = [
        Reply(tool_calls=[("bash", '{"command": "ls"')]),  # cut-off JSON
        Reply(tool_calls=[("bash", '{"command": 5}'), ("rm_everything", "{}")]),
        Reply(tool_calls=[("read_file", '{"path": "missing.txt"}')]),
        Reply(content="Giving up.", tool_calls=[FINISH]),
    ]
    run = run_agent(gateway, fake_backend, tmp_path, script)
    assert run.proc.returncode == EXIT_FINISHED, run.proc.stderr
    outputs = tool_outputs(run)
    assert outputs[0].startswith("error: the arguments of bash are not valid JSON")
    assert outputs[1] == "error: bash takes a JSON object with string fields ['command']"
    assert outputs[2].startswith("error: unknown tool 'rm_everything'")
    assert outputs[3].startswith("error: ") and "missing.txt" in outputs[3]
    assert [e["ok"] for e in run.transcript if e["type"] == "tool"] == [False, False, False, False, True]
    # The model saw its mistake: the error went back as the tool message for that call id.
    second = fake_backend.app.requests[1]["messages"]
    assert second[-1]["role"] == "tool" and second[-1]["content"] == outputs[0]
    assert second[-1]["tool_call_id"] == second[-2]["tool_calls"][0]["id"]
    assert len(gateway.completions(run.sid)) == 4


def test_max_turns_stops_the_loop(gateway: Gateway, fake_backend: FakeBackend, tmp_path: Path) -> None:
    run = run_agent(
        gateway, fake_backend, tmp_path, lambda body: Reply(tool_calls=[("bash", '{"command": "true"}')]),
        "--max-turns", "2",
    )  # fmt: skip
    assert run.proc.returncode == EXIT_MAX_TURNS
    assert "stopped after 2 turns without finishing" in run.proc.stderr
    assert run.transcript[-1] == {"type": "end", "finished": False, "reason": "max_turns", "turns": 2}
    assert len(gateway.completions(run.sid)) == 2


def test_final_answer_without_tool_calls_finishes(
    gateway: Gateway, fake_backend: FakeBackend, tmp_path: Path
) -> None:
    run = run_agent(gateway, fake_backend, tmp_path, [Reply(content="Nothing to do here.")])
    assert run.proc.returncode == EXIT_FINISHED, run.proc.stderr
    end = run.transcript[-1]
    assert end["reason"] == "final_answer" and end["summary"] == "Nothing to do here." and end["turns"] == 1


def test_unknown_key_is_an_api_error(gateway: Gateway, fake_backend: FakeBackend, tmp_path: Path) -> None:
    run = run_agent(gateway, fake_backend, tmp_path, [Reply(content="unused")], key="not-a-session")
    assert run.proc.returncode == EXIT_API_ERROR
    assert "polar agent: model API error on turn 1" in run.proc.stderr and "401" in run.proc.stderr
    assert run.transcript[-1]["reason"] == "api_error" and "401" in run.transcript[-1]["error"]
    assert fake_backend.app.requests == []  # refused at the gateway


def test_bash_timeout_kills_the_tree_and_output_is_clipped(
    gateway: Gateway, fake_backend: FakeBackend, tmp_path: Path
) -> None:
    script = [
        # A background child keeps the pipe open: only killing the process group ends the wait.
        Reply(tool_calls=[("bash", '{"command": "sleep 60 & sleep 60"}')]),
        Reply(tool_calls=[("bash", '{"command": "head -c 5000 /dev/zero | tr \'\\\\0\' a"}')]),
        Reply(tool_calls=[FINISH]),
    ]
    run = run_agent(gateway, fake_backend, tmp_path, script, "--bash-timeout", "0.5", "--max-output", "300")
    assert run.proc.returncode == EXIT_FINISHED, run.proc.stderr
    timed_out, long = tool_outputs(run)[:2]
    assert timed_out.startswith("exit code: 124 (timed out after 0.5 s)")
    assert long.startswith("exit code: 0\n" + "a" * 150) and "[... 4700 characters cut ...]" in long


def test_usage_errors(gateway: Gateway, fake_backend: FakeBackend, tmp_path: Path) -> None:
    no_model = run_agent(
        gateway, fake_backend, tmp_path / "a", [Reply(content="x")], env={"OPENAI_MODEL": ""}
    )
    assert no_model.proc.returncode == EXIT_USAGE and "no model" in no_model.proc.stderr
    bad = run_agent(gateway, fake_backend, tmp_path / "b", [Reply(content="x")], "--max-turns", "0")
    assert bad.proc.returncode == EXIT_USAGE and "--max-turns" in bad.proc.stderr
