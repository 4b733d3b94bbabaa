"""A session through INIT -> READY -> RUNNING -> POSTRUN on a real node: the shell harness and the built-in
agent against the gateway in front of the scripted fake vLLM, real runtimes, evaluators and rewards."""

from __future__ import annotations

import json
from pathlib import Path

from polar.rollout.protocol import SessionStatus
from polar.trajectory import Trajectory
from tests.fakes.fake_vllm import Reply
from tests.node_support import PY, fake_policy, running_node, shell_task, spec, write_caller


async def test_shell_session_completes_with_trajectory_and_reward(tmp_path: Path) -> None:
    caller = write_caller(tmp_path)
    task = shell_task(
        f"{PY} {caller} 2 > answer.txt",
        evaluator={
            "strategy": "test_on_output",
            "config": {"command": "cat answer.txt", "expect": "All done.", "match": "contains"},
        },
        metadata={"policy_version": 7, "rollout_step": 3},
    )
    with fake_policy([Reply("Working."), Reply("All done.")]) as (url, fake):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-shell-1", sample_index=2, group_id="g1"))
            result = await node.wait("sess-shell-1")
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reward == 1.0
    assert len(fake.requests) == 2
    traj = Trajectory.model_validate(result.trajectory)
    assert traj.status == "COMPLETED"
    assert len(traj.traces) == 1  # the second call extends the first: one prefix-merged trace
    assert [t.reward for t in traj.traces] == [1.0]
    assert traj.traces[0].trainable_tokens > 0
    for meta in (traj.metadata, result.metadata):
        assert meta["task_id"] == "t1"
        assert meta["group_id"] == "g1"
        assert meta["sample_index"] == 2
        assert meta["policy_version"] == 7
        assert meta["rollout_step"] == 3
    assert set(result.timings) >= {"queued_s", "init_s", "ready_wait_s", "run_s", "post_s", "total_s"}
    assert not list((tmp_path / "runtimes").iterdir())  # torn down


async def test_builtin_agent_session(tmp_path: Path) -> None:
    write = json.dumps({"path": "hello.txt", "content": "hi there\n"})
    script = [
        Reply(tool_calls=[("write_file", write)]),
        Reply(tool_calls=[("finish", '{"summary": "wrote it"}')]),
    ]
    task = shell_task(
        "unused",
        agent={"harness": "builtin", "settings": {}},
        evaluator={
            "strategy": "test_on_output",
            "config": {"command": "cat hello.txt", "expect": "hi there"},
        },
    )
    with fake_policy(script) as (url, fake):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-builtin-1"))
            result = await node.wait("sess-builtin-1")
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reward == 1.0
    assert len(fake.requests) == 2
    traj = Trajectory.model_validate(result.trajectory)
    assert len(traj.traces) == 1
    assert 0 in traj.traces[0].loss_mask  # the tool result is in the trace, masked
    assert result.metadata["harness"]["finished"] is True


async def test_nonzero_exit_is_evaluated_not_an_error(tmp_path: Path) -> None:
    task = shell_task("exit 3")  # session_completed: reward 0 for an agent that did not exit 0
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-exit-3"))
            result = await node.wait("sess-exit-3")
    assert result.status == SessionStatus.COMPLETED
    assert result.reason == "harness exited with code 3"
    assert result.reward == 0.0
