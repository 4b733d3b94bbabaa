"""A session through INIT -> READY -> RUNNING -> POSTRUN on a real node: the shell harness and the built-in
agent against the gateway in front of the scripted fake vLLM, real runtimes, evaluators and rewards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from polar.harness.base import Extensions
from polar.harness.builtin import TRANSCRIPT
from polar.harness.shell import ShellHarness
from polar.rollout.protocol import SessionStatus
from polar.store.records import CompletionRecord
from polar.trajectory import Trajectory, TrajectoryStatus
from polar.trajectory.per_request import per_request
from tests.fakes.fake_vllm import Reply
from tests.node_support import (
    PY,
    fake_policy,
    running_node,
    sandboxed_caller_task,
    shell_task,
    spec,
    write_caller,
)


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
        async with running_node(url, tmp_path, keep="artifacts") as node:
            await node.submit(spec(task, "sess-builtin-1"))
            result = await node.wait("sess-builtin-1")
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reward == 1.0
    assert len(fake.requests) == 2
    traj = Trajectory.model_validate(result.trajectory)
    assert len(traj.traces) == 1
    assert 0 in traj.traces[0].loss_mask  # the tool result is in the trace, masked
    assert result.metadata["harness"]["finished"] is True
    # keep="artifacts": the transcript survives teardown, the workspace does not.
    (kept,) = (tmp_path / "runtimes").iterdir()
    assert [p.name for p in kept.iterdir()] == ["artifacts"]
    assert (kept / "artifacts" / TRANSCRIPT).read_text().count("\n") >= 2


async def test_nonzero_exit_is_evaluated_not_an_error(tmp_path: Path) -> None:
    task = shell_task("exit 3")  # session_completed: reward 0 for an agent that did not exit 0
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-exit-3"))
            result = await node.wait("sess-exit-3")
    assert result.status == SessionStatus.COMPLETED
    assert result.reason == "harness exited with code 3"
    assert result.reward == 0.0


@pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap not installed (scripts/test installs it)"
)
async def test_bwrap_session_reaches_only_the_gateway(tmp_path: Path) -> None:
    """In a bubblewrap sandbox (network=gateway) the harness reaches the node's gateway through the URL the
    runtime publishes; the caller script arrives by an upload prepare step (the host's /tmp is hidden)."""
    task = sandboxed_caller_task(tmp_path)
    with fake_policy([Reply("one"), Reply("sandboxed")]) as (url, fake):
        async with running_node(url, tmp_path, upload_roots=(tmp_path,)) as node:
            await node.submit(spec(task, "sess-bwrap-1"))
            result = await node.wait("sess-bwrap-1")
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reward == 1.0 and len(fake.requests) == 2
    assert len(Trajectory.model_validate(result.trajectory).traces) == 1


async def test_harness_tags_reach_the_builder(tmp_path: Path) -> None:
    caller = write_caller(tmp_path)
    task = shell_task(
        f"{PY} {caller} 2",
        agent={"harness": "tests.test_node_lifecycle:TaggingShell"},
        builder="tests.test_node_lifecycle:tags_builder",
    )
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-tags"))
            result = await node.wait("sess-tags")
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.trajectory is not None
    assert result.trajectory["metadata"]["tags"] == [["main"], ["side_call", "title"]]


class TaggingShell(ShellHarness):
    """The shell preset whose classifier calls every call after the first a side call."""

    def classify(self, record: CompletionRecord) -> tuple[str, ...]:
        return ("side_call", "title") if record.seq > 0 else ("main",)


def tags_builder(records: list[CompletionRecord], *, status: TrajectoryStatus) -> Trajectory:
    trajectory = per_request(records, status=status)
    return trajectory.model_copy(
        update={"metadata": {**trajectory.metadata, "tags": [list(r.tags) for r in records]}}
    )


class McpShell(ShellHarness):
    """The shell preset, declaring that its program starts the task's MCP servers (it does not)."""

    extensions = Extensions(mcp="nowhere (a test harness)", tool_name="{tool}", skills=None, missing="")


async def test_a_missing_mcp_server_program_ends_the_session_before_the_harness_starts(
    tmp_path: Path,
) -> None:
    """Some CLIs wait for a server that cannot start until the deadline (OpenHands 1.16) or go on without
    its tools (Claude Code): the node ends the session at setup, naming the server, without a call."""
    marker = tmp_path / "started"
    task = shell_task(
        f"touch {marker}",
        agent={
            "harness": "tests.test_node_lifecycle:McpShell",
            "mcp_servers": {"weather": {"command": "no-such-mcp-server"}, "shell": {"command": "sh"}},
        },
    )
    with fake_policy() as (url, fake):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-mcp-missing"))
            result = await node.wait("sess-mcp-missing")
    assert result.status == SessionStatus.ERROR
    assert result.reason is not None and result.reason.startswith(
        "agent.mcp_servers: the runtime has no program for weather ('no-such-mcp-server' not found on PATH="
    ), result.reason
    assert "shell (" not in result.reason
    assert not marker.exists() and not fake.requests
