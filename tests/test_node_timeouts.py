"""Deadlines: one per session from INIT, an optional agent budget from RUN. A run that times out after the
policy was called still yields a partial trajectory with status TIMEOUT; which clock ran out decides the
reward (agent budget: trainable zero; session deadline: fully masked)."""

from __future__ import annotations

from pathlib import Path

from polar.rollout.protocol import SessionStatus
from polar.rollout.rewards import AGENT_BUDGET_EXHAUSTED, SESSION_DEADLINE
from polar.trajectory import Trajectory
from tests.node_support import ON_HOST, PY, fake_policy, pids_under, running_node, shell_task, spec, until

# One chat call with the standard library: starts in ~50 ms, so the call lands well inside a 1 s budget even
# on a loaded machine (the openai SDK alone takes about a second to import there).
_QUICK_CALL = """
import json, os, urllib.request
body = json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": "hi"}]})
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body.encode(),
                             {"authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                              "content-type": "application/json"})
urllib.request.urlopen(req).read()
"""


def _hang_after_call(tmp_path: Path) -> str:
    """One call to the policy, then a hang with a child process (the tree must die on timeout); the pid
    file and the process check are the host's, so these sessions run `local` (ON_HOST)."""
    caller = tmp_path / "quick_call.py"
    caller.write_text(_QUICK_CALL)
    return f"{PY} {caller} && (sleep 60 & echo $! > {tmp_path}/child.pid; wait)"


async def test_agent_budget_timeout_keeps_a_trainable_partial_trajectory(tmp_path: Path) -> None:
    task = shell_task(
        _hang_after_call(tmp_path), agent={"budget_seconds": 1.0}, timeout_seconds=60, runtime=ON_HOST
    )
    with fake_policy() as (url, fake):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-budget"))
            result = await node.wait("sess-budget")
    assert result.status == SessionStatus.TIMEOUT
    assert result.reason is not None and result.reason.startswith(AGENT_BUDGET_EXHAUSTED)
    assert len(fake.requests) == 1
    traj = Trajectory.model_validate(result.trajectory)
    assert traj.status == "TIMEOUT" and len(traj.traces) == 1
    assert traj.traces[0].trainable_tokens > 0 and traj.traces[0].reward == 0.0
    assert result.reward == 0.0
    assert (tmp_path / "child.pid").exists()  # the child ran; none of the tree survives
    await until(lambda: not pids_under(tmp_path / "runtimes", "sleep", "60"), "the tree to die")


async def test_session_deadline_timeout_is_partial_and_masked(tmp_path: Path) -> None:
    task = shell_task(_hang_after_call(tmp_path), timeout_seconds=1.5, runtime=ON_HOST)
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-deadline"))
            result = await node.wait("sess-deadline")
    assert result.status == SessionStatus.TIMEOUT
    assert result.reason is not None and result.reason.startswith(SESSION_DEADLINE)
    traj = Trajectory.model_validate(result.trajectory)
    assert traj.status == "TIMEOUT" and len(traj.traces) == 1
    assert traj.traces[0].trainable_tokens == 0 and traj.metadata["masked"] is True
    assert result.reward is None
    assert (tmp_path / "child.pid").exists()  # the child ran; none of the tree survives
    await until(lambda: not pids_under(tmp_path / "runtimes", "sleep", "60"), "the tree to die")


async def test_budget_longer_than_the_deadline_counts_as_deadline(tmp_path: Path) -> None:
    task = shell_task("sleep 30", agent={"budget_seconds": 100.0}, timeout_seconds=1.0)
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-deadline-first"))
            result = await node.wait("sess-deadline-first")
    assert result.status == SessionStatus.TIMEOUT
    assert result.reason is not None and result.reason.startswith(SESSION_DEADLINE)
    traj = Trajectory.model_validate(result.trajectory)
    assert traj.traces == []  # no call was captured: nothing to train on


async def test_hang_in_init_times_out_against_the_session_deadline(tmp_path: Path) -> None:
    task = shell_task(
        "true",
        timeout_seconds=0.8,
        runtime={"prepare": [{"type": "exec", "cmd": "sleep 30", "timeout_seconds": 60}]},
    )
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-init-hang"))
            result = await node.wait("sess-init-hang")
    assert result.status == SessionStatus.TIMEOUT
    assert result.reason is not None and SESSION_DEADLINE in result.reason
    assert result.trajectory is None
    assert not list((tmp_path / "runtimes").iterdir())


async def test_queue_time_before_init_is_not_charged(tmp_path: Path) -> None:
    """With one INIT worker held by a slow prepare step, the second session waits longer than its whole
    deadline before INIT, and still completes: its clock starts at INIT."""
    slow = shell_task("true", runtime={"prepare": [{"type": "exec", "cmd": "sleep 1.5"}]})
    quick = shell_task("true", task_id="t2", timeout_seconds=1.0)
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, init_workers=1) as node:
            await node.submit(spec(slow, "sess-slow-init"))
            await node.submit(spec(quick, "sess-queued"))
            queued = await node.wait("sess-queued")
    assert queued.status == SessionStatus.COMPLETED, queued.reason
    assert queued.timings["queued_s"] > 1.0  # the wait it was not charged for (a fact, not a timing bound)
