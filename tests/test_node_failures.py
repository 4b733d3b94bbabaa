"""Every failure ends in a recorded terminal status with its reason, frees its runtime, and does not block
the sessions around it: prepare retries, a runtime that cannot start, harness crashes, evaluator faults."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar.rollout.protocol import SessionStatus
from polar.trajectory import Trajectory
from tests.node_support import PY, fake_policy, running_node, shell_task, spec, write_caller

# Fails the first time it runs in a runtime, succeeds the second: a flaky install step.
FLAKY = "if [ -f .tried ]; then echo ok > prepared.txt; else touch .tried; echo flaky >&2; exit 1; fi"


async def test_prepare_exec_is_retried(tmp_path: Path) -> None:
    task = shell_task(
        "cat prepared.txt",
        runtime={"prepare": [{"type": "exec", "cmd": FLAKY, "retries": 1}]},
        evaluator={"strategy": "test_on_output", "config": {"command": "cat prepared.txt", "expect": "ok"}},
    )
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-retry-ok"))
            result = await node.wait("sess-retry-ok")
    assert result.status == SessionStatus.COMPLETED, result.reason
    assert result.reward == 1.0


async def test_prepare_exec_out_of_retries_is_an_error(tmp_path: Path) -> None:
    task = shell_task(
        "true", runtime={"prepare": [{"type": "exec", "cmd": "echo broken >&2; exit 2", "retries": 2}]}
    )
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-retry-bad"))
            result = await node.wait("sess-retry-bad")
            assert node.status().active == 0
    assert result.status == SessionStatus.ERROR
    assert result.reason is not None
    assert "prepare step 0" in result.reason and "3 attempt(s)" in result.reason and "broken" in result.reason
    assert result.trajectory is None and result.reward is None
    assert not list((tmp_path / "runtimes").iterdir())


async def test_upload_prepare_action(tmp_path: Path) -> None:
    src = tmp_path / "repo"
    src.mkdir()
    (src / "README").write_text("uploaded\n")
    task = shell_task(
        "true",
        runtime={"prepare": [{"type": "upload", "src": str(src), "dst": "."}]},
        evaluator={"strategy": "test_on_output", "config": {"command": "cat README", "expect": "uploaded"}},
    )
    missing = shell_task("true", runtime={"prepare": [{"type": "upload", "src": str(tmp_path / "nope")}]})
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, upload_roots=(tmp_path,)) as node:
            await node.submit(spec(task, "sess-upload"))
            await node.submit(spec(missing, "sess-upload-missing"))
            ok = await node.wait("sess-upload")
            bad = await node.wait("sess-upload-missing")
    assert ok.status == SessionStatus.COMPLETED and ok.reward == 1.0
    assert bad.status == SessionStatus.ERROR
    assert bad.reason is not None and "prepare step 0: upload" in bad.reason


async def test_runtime_that_cannot_start_is_an_error_and_others_run(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the runtime root should be")
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, runtime_root=blocker / "runtimes") as node:
            await node.submit(spec(shell_task("true"), "sess-nostart"))
            result = await node.wait("sess-nostart")
    assert result.status == SessionStatus.ERROR
    assert result.reason is not None and result.reason.startswith("runtime failed to start")
    assert result.timings["init_s"] >= 0 and "run_s" not in result.timings


async def test_harness_killed_by_signal_or_missing_is_an_error(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(shell_task("kill -9 $$"), "sess-killed"))
            await node.submit(spec(shell_task("no-such-agent-binary --go"), "sess-missing"))
            killed = await node.wait("sess-killed")
            missing = await node.wait("sess-missing")
    assert killed.status == SessionStatus.ERROR
    assert killed.reason is not None and "signal 9" in killed.reason
    assert missing.status == SessionStatus.ERROR
    assert missing.reason is not None and "failed to start (127)" in missing.reason
    assert not list((tmp_path / "runtimes").iterdir())


async def test_harness_setup_failure_is_an_error(tmp_path: Path) -> None:
    task = shell_task("true", runtime={"env": {"PATH": "/nonexistent"}})  # setup cannot even find `sh`
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-setup"))
            result = await node.wait("sess-setup")
    assert result.status == SessionStatus.ERROR
    assert result.reason is not None and result.reason.startswith("harness setup failed")


async def test_evaluator_timeout_is_an_error_with_a_masked_trajectory(tmp_path: Path) -> None:
    caller = write_caller(tmp_path)
    task = shell_task(
        f"{PY} {caller}",
        evaluator={"strategy": "test_on_output", "config": {"command": "sleep 30"}, "timeout_seconds": 0.5},
    )
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-eval-slow"))
            result = await node.wait("sess-eval-slow")
    assert result.status == SessionStatus.ERROR
    assert result.reason == "evaluator timed out after 0.5 s"
    assert result.reward is None
    traj = Trajectory.model_validate(result.trajectory)
    assert traj.status == "ERROR" and len(traj.traces) == 1
    assert traj.traces[0].trainable_tokens == 0  # fail-closed: fully masked


async def test_evaluator_crash_is_an_error(tmp_path: Path) -> None:
    task = shell_task("true", evaluator={"strategy": "tests.test_node_failures:Exploding"})
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(task, "sess-eval-crash"))
            result = await node.wait("sess-eval-crash")
    assert result.status == SessionStatus.ERROR
    assert result.reason == "evaluator failed: ValueError: scoring exploded"


class Exploding:
    """An evaluator that raises (loaded by import path, like any custom evaluator)."""

    name = "exploding"
    needs_fresh_runtime = False

    async def evaluate(self, ctx: object) -> object:
        raise ValueError("scoring exploded")


async def test_post_run_hook_that_hangs_is_an_error(tmp_path: Path) -> None:
    task = shell_task("true", agent={"harness": "tests.test_node_failures:SlowCollector", "settings": {}})
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, post_run_timeout_s=0.3) as node:
            await node.submit(spec(task, "sess-post-hang"))
            result = await node.wait("sess-post-hang")
    assert result.status == SessionStatus.ERROR
    assert result.reason == "harness post-run hook timed out after 0.3 s"
    assert not list((tmp_path / "runtimes").iterdir())


class SlowCollector:
    """The shell preset whose log collection never returns (a harness plugin loaded by import path)."""

    name = "slow_collector"

    def __init__(self, settings: dict[str, object]) -> None:
        from polar.harness.shell import ShellHarness

        self._shell = ShellHarness(dict(settings) or {"command": "true"})

    async def setup(self, runtime: object, ctx: object) -> None:
        await self._shell.setup(runtime, ctx)  # type: ignore[arg-type]

    def command(self, ctx: object) -> str:
        return self._shell.command(ctx)  # type: ignore[arg-type]

    def env(self, ctx: object) -> dict[str, str]:
        return self._shell.env(ctx)  # type: ignore[arg-type]

    async def post_run(self, runtime: object, ctx: object) -> dict[str, object]:
        import asyncio

        await asyncio.sleep(60)
        return {}

    def classify(self, record: object) -> tuple[str, ...]:
        return ()


async def test_builder_or_classifier_failure_is_an_error(tmp_path: Path) -> None:
    caller = write_caller(tmp_path)
    bad_builder = shell_task(f"{PY} {caller}", builder="tests.test_node_failures:broken_builder")
    bad_classify = shell_task(
        "unused",
        agent={
            "harness": "tests.test_node_failures:BadClassifier",
            "settings": {"command": f"{PY} {caller}"},
        },
    )
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            await node.submit(spec(bad_builder, "sess-bad-builder"))
            await node.submit(spec(bad_classify, "sess-bad-classify"))
            built = await node.wait("sess-bad-builder")
            classified = await node.wait("sess-bad-classify")
    assert built.status == SessionStatus.ERROR
    assert built.reason == (
        "trajectory builder 'tests.test_node_failures:broken_builder' failed: RuntimeError: no chains today"
    )
    assert classified.status == SessionStatus.ERROR
    assert classified.reason == "harness classify failed: KeyError: 'seq'"
    assert not list((tmp_path / "runtimes").iterdir())


def broken_builder(records: object, *, status: object) -> object:
    raise RuntimeError("no chains today")


class BadClassifier(SlowCollector):
    async def post_run(self, runtime: object, ctx: object) -> dict[str, object]:
        return {}

    def classify(self, record: object) -> tuple[str, ...]:
        raise KeyError("seq")


@pytest.mark.parametrize("status", [503, 404, 409])  # down; its model gone (was a sample); a replay's refusal
async def test_agent_failing_because_the_backend_failed_is_an_infrastructure_error(
    tmp_path: Path, status: int
) -> None:
    """The agent exits non-zero after the policy's server failed its calls: ERROR (fully masked), not an
    agent outcome with reward 0 that a trainer would learn from."""
    caller = write_caller(tmp_path)
    with fake_policy() as (url, backend):
        async with running_node(url, tmp_path) as node:
            backend.set(status=status)
            await node.submit(spec(shell_task(f"{PY} {caller} 1"), "sess-backend-down"))
            down = await node.wait("sess-backend-down")
            backend.set(status=None)
            # The policy's own failure stays an agent outcome: the harness exits 1 with no gateway failure.
            await node.submit(spec(shell_task("exit 1"), "sess-gave-up"))
            gave_up = await node.wait("sess-gave-up")
    assert down.status == SessionStatus.ERROR
    assert (
        down.reason is not None and "inference backend failed" in down.reason and str(status) in down.reason
    )
    assert gave_up.status == SessionStatus.COMPLETED and gave_up.reason == "harness exited with code 1"
