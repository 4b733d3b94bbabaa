"""The staged pipeline: separate bounded pools per stage, a bounded READY buffer, stages that overlap (a
long RUN never blocks the next sessions' INIT), and the evaluator's fresh runtime prepared during RUN."""

from __future__ import annotations

from pathlib import Path

from polar.rollout.protocol import SessionStatus
from tests.node_support import ON_HOST, fake_policy, running_node, shell_task, spec, until


def _wait_for(gate: Path) -> str:
    return f"while [ ! -f {gate} ]; do sleep 0.05; done"


async def test_long_run_does_not_block_init_and_ready_buffer_is_bounded(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    prepared = tmp_path / "prepared.log"
    task = shell_task(
        _wait_for(gate), runtime={**ON_HOST, "prepare": [{"type": "exec", "cmd": f"echo x >> {prepared}"}]}
    )
    ids = [f"sess-pool-{i}" for i in range(5)]
    with fake_policy() as (url, _):
        async with running_node(
            url, tmp_path, capacity=5, init_workers=2, run_workers=1, ready_buffer=1, post_workers=1
        ) as node:
            for sid in ids:
                await node.submit(spec(task, sid))
            # One session runs (it waits for the gate); the next is READY; two more finished INIT and hold
            # the INIT workers waiting for a place in the buffer; the last waits for an INIT worker.
            await until(lambda: prepared.exists() and len(prepared.read_text().split()) == 4, "four INITs")
            await until(
                lambda: (
                    node.status().by_stage == {"RUNNING": 1, "READY": 1, "INITIALIZING": 2, "DISPATCHED": 1}
                ),
                "the pipeline to fill",
            )
            assert node.ready.busy == 1 and node.run_pool.busy == 1 and node.init_pool.busy == 2
            gate.touch()
            results = [await node.wait(sid) for sid in ids]
            assert node.ready.peak == 1 and node.run_pool.peak == 1 and node.init_pool.peak == 2
            assert node.post_pool.peak == 1
    assert [r.status for r in results] == [SessionStatus.COMPLETED] * 5


async def test_evaluator_runtime_is_prepared_while_the_agent_runs(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    prepared = tmp_path / "prepared.log"
    task = shell_task(
        f"{_wait_for(gate)}; echo agent-was-here > mark.txt",
        runtime={
            **ON_HOST,
            "prepare": [{"type": "exec", "cmd": f"echo x >> {prepared}; echo clean > state.txt"}],
        },
        # A fresh runtime is a clean copy of the task: the agent's mark is not in it.
        evaluator={
            "strategy": "tests.test_node_pools:FreshChecker",
            "fresh_runtime": True,
        },
    )
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-prewarm"))
            await until(lambda: prepared.exists() and len(prepared.read_text().split()) == 2, "the prewarm")
            assert node.state("sess-prewarm").status == SessionStatus.RUNNING  # type: ignore[union-attr]
            gate.touch()
            result = await node.wait("sess-prewarm")
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reward == 1.0
    assert result.metadata["evaluation"]["details"] == {"fresh": "clean", "agent": "agent-was-here"}
    assert not list((tmp_path / "runtimes").iterdir())  # both runtimes torn down


async def test_evaluator_runtime_that_fails_to_prepare_is_an_error(tmp_path: Path) -> None:
    flag = tmp_path / "agent-prepared"
    # The agent's runtime prepares fine; the second (fresh) one finds the flag and fails.
    cmd = f"if [ -f {flag} ]; then echo fresh-broken >&2; exit 1; fi; touch {flag}"
    task = shell_task(
        "true",
        runtime={**ON_HOST, "prepare": [{"type": "exec", "cmd": cmd}]},
        evaluator={"strategy": "tests.test_node_pools:FreshChecker", "fresh_runtime": True},
    )
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-prewarm-bad"))
            result = await node.wait("sess-prewarm-bad")
    assert result.status == SessionStatus.ERROR
    assert result.reason is not None and result.reason.startswith("evaluator runtime: prepare step 0")
    assert not list((tmp_path / "runtimes").iterdir())


class FreshChecker:
    """Reads state from both runtimes: reward 1 when the fresh one is clean and the agent's has its mark."""

    name = "fresh_checker"
    needs_fresh_runtime = True

    async def evaluate(self, ctx: object) -> object:
        from polar.evaluate.base import EvalContext, EvalResult

        assert isinstance(ctx, EvalContext) and ctx.fresh is not None
        fresh = (await ctx.fresh.exec("cat state.txt; cat mark.txt 2>/dev/null")).stdout.strip()
        agent = (await ctx.runtime.exec("cat mark.txt")).stdout.strip()
        ok = fresh == "clean" and agent == "agent-was-here"
        return EvalResult(reward=1.0 if ok else 0.0, passed=ok, details={"fresh": fresh, "agent": agent})


async def test_slow_evaluations_do_not_hold_run_slots(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    task = shell_task(
        "true",
        evaluator={"strategy": "test_on_output", "config": {"command": _wait_for(gate)}},
        runtime=ON_HOST,
    )
    ids = [f"sess-post-{i}" for i in range(3)]
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, run_workers=1, post_workers=1) as node:
            for sid in ids:
                await node.submit(spec(task, sid))
            # Every agent ran through the single run slot while the first evaluation holds the only
            # POSTRUN worker: the others wait in POST_RUN, not in RUNNING.
            await until(lambda: node.status().by_stage == {"EVALUATING": 1, "POST_RUN": 2}, "all runs done")
            assert node.run_pool.busy == 0 and node.post_pool.busy == 1
            gate.touch()
            results = [await node.wait(sid) for sid in ids]
    assert [r.status for r in results] == [SessionStatus.COMPLETED] * 3
    assert all(r.reward == 1.0 for r in results)
