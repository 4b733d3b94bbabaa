"""Cancellation (DELETE, early stop): the whole process tree dies, the runtime is freed, the session ends
CANCELLED, in whatever stage it was."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polar.rollout.protocol import NodeSessionState, SessionStatus
from tests.node_support import (
    ON_HOST,
    control_client,
    fake_policy,
    pids_under,
    running_node,
    shell_task,
    spec,
    until,
)

# A harness with a grandchild: the runtime's process group, a subshell, and a background sleep.
_TREE = "(sleep 60 & wait) & wait"


async def test_cancel_mid_run_kills_the_process_tree(tmp_path: Path) -> None:
    runtimes = tmp_path / "runtimes"
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(shell_task(_TREE), "sess-cancel"))
            await until(lambda: bool(pids_under(runtimes, "sleep", "60")), "run")
            tree = pids_under(runtimes)
            assert len(tree) >= 3  # the harness's shell, its subshell and the sleep (at least)
            state = await node.cancel("sess-cancel", "early stop: enough usable samples")
            assert state is not None and state.status == SessionStatus.CANCELLED
            result = await node.wait("sess-cancel")
            assert node.status().active == 0
    await until(lambda: not pids_under(runtimes), "the tree to die")
    assert result.status == SessionStatus.CANCELLED
    assert result.reason == "early stop: enough usable samples"
    assert result.reward is None
    assert not list((tmp_path / "runtimes").iterdir())


async def test_delete_over_http_and_cancel_of_a_queued_session(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    blocker = shell_task(
        "true",
        runtime={
            **ON_HOST,
            "prepare": [{"type": "exec", "cmd": f"while [ ! -f {gate} ]; do sleep 0.05; done"}],
        },
    )
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, init_workers=1) as node:
            await node.submit(spec(blocker, "sess-blocker"))
            await node.submit(spec(shell_task("true"), "sess-queued"))
            await until(lambda: node.status().by_stage.get("INITIALIZING") == 1, "the blocker in INIT")
            assert node.state("sess-queued").status == SessionStatus.DISPATCHED  # type: ignore[union-attr]
            async with control_client(node) as client:
                r = await client.delete("/node/sessions/sess-queued", params={"reason": "trainer cancelled"})
                assert r.status_code == 200, r.text
                state = NodeSessionState.model_validate(r.json())
                assert state.status == SessionStatus.CANCELLED
                assert state.result is not None and state.result.reason == "trainer cancelled"
                assert "init_s" not in state.result.timings  # it never reached INIT
                r = await client.delete("/node/sessions/sess-blocker")
                assert r.json()["status"] == "CANCELLED"
                again = await client.delete("/node/sessions/sess-blocker")  # idempotent
                assert again.status_code == 200 and again.json()["status"] == "CANCELLED"
                missing = await client.delete("/node/sessions/never-seen")
                assert missing.status_code == 404
    assert not list((tmp_path / "runtimes").iterdir())


async def test_cancel_during_evaluation(tmp_path: Path) -> None:
    task = shell_task("true", evaluator={"strategy": "test_on_output", "config": {"command": "sleep 30"}})
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-cancel-eval"))
            await until(lambda: node.status().by_stage.get("EVALUATING") == 1, "evaluation")
            await asyncio.sleep(0.1)
            state = await node.cancel("sess-cancel-eval")
    assert state is not None and state.result is not None
    assert state.status == SessionStatus.CANCELLED
    assert state.result.trajectory is not None and state.result.trajectory["status"] == "ERROR"  # masked
    assert not list((tmp_path / "runtimes").iterdir())


async def test_stopping_the_node_cancels_what_runs(tmp_path: Path) -> None:
    runtimes = tmp_path / "runtimes"
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(shell_task(_TREE), "sess-stop"))
            await until(lambda: bool(pids_under(runtimes, "sleep", "60")), "run")
        state = node.state("sess-stop")
    assert state is not None and state.status == SessionStatus.CANCELLED
    assert state.result is not None and state.result.reason == "node stopped"
    await until(lambda: not pids_under(runtimes), "the tree to die")


async def test_cancel_right_after_submit_never_wedges(tmp_path: Path) -> None:
    """Cancelling a session before its driver task took its first step: asyncio never runs a coroutine
    cancelled before it started, so nothing in it could finish the session. 40 of them, cancelled one by
    one and all at once (the server's early stop), and the node still frees every slot and stops."""
    n = 40
    nodes = []

    async def scenario() -> None:
        with fake_policy() as (url, _):
            async with running_node(url, tmp_path, capacity=n) as node:
                nodes.append(node)
                for i in range(n // 2):
                    await node.submit(spec(shell_task("sleep 30"), f"one-{i}"))
                    state = await node.cancel(f"one-{i}", "trainer cancelled")
                    assert state is not None and state.status == SessionStatus.CANCELLED
                for i in range(n // 2):
                    await node.submit(spec(shell_task("sleep 30"), f"all-{i}"))
                states = await asyncio.gather(*(node.cancel(f"all-{i}", "early stop") for i in range(n // 2)))
                assert all(s is not None and s.status == SessionStatus.CANCELLED for s in states)
                assert node.status().active == 0 and node.status().by_stage == {}
                results = [await node.wait(f"one-{i}") for i in range(n // 2)]
                assert {(r.status, r.reason) for r in results} == {
                    (SessionStatus.CANCELLED, "trainer cancelled")
                }
                await node.submit(spec(shell_task("true"), "after"))  # the slots are free again
                assert (await node.wait("after")).status == SessionStatus.COMPLETED
                await node.stop()  # what SIGTERM runs

    # Not wait_for: it would wait for the wedged scenario to unwind, which a wedged stop never does.
    run = asyncio.create_task(scenario())
    done, _ = await asyncio.wait({run}, timeout=120)
    if not done:
        for s in nodes[0]._sessions.values():  # release the wedged waiters, or the loop's teardown hangs
            s.done.set()
        pytest.fail("a cancel or the node's stop never finished")
    run.result()
    assert not list((tmp_path / "runtimes").iterdir())
