"""The shipped task suite (examples/): it loads, each task's tests really fail on the shipped repo, and the
reference fix (examples/repos/<name>.solution.patch) makes the task's own evaluator give reward 1."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polar.evaluate import CommandEvaluator, EvalContext, fresh_runtime_wanted, get_evaluator
from polar.rollout.protocol import SessionStatus
from polar.rollout.taskfile import load_tasks
from polar.runtime.base import ExecResult, RuntimeSpec
from polar.runtime.local import LocalRuntime
from polar.task import ExecAction, Task, UploadAction
from polar.trajectory.models import Trajectory
from tests.fakes.fake_vllm import Reply
from tests.node_support import fake_policy, running_node, spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TASKS = load_tasks(EXAMPLES / "tasks.yaml")
REPOS = sorted(p.name for p in (EXAMPLES / "repos").iterdir() if p.is_dir() and not p.name.startswith("."))


def test_suite_shape() -> None:
    assert 4 <= len(TASKS) <= 6
    assert sorted(t.metadata["repo"] for t in TASKS) == REPOS  # one task per shipped repo
    for task in TASKS:
        assert task.num_samples == 2
        assert task.metadata["group_id"] == task.task_id
        assert task.runtime.backend is None  # the node's default sandbox
        assert task.agent.harness == "builtin"
        assert task.evaluator.strategy == "command" and task.evaluator.fresh_runtime is True
        ev = get_evaluator(task.evaluator.strategy, task.evaluator.config)
        assert isinstance(ev, CommandEvaluator) and ev.config.runner == "unittest"  # the hardened form
        assert fresh_runtime_wanted(ev, task.evaluator.fresh_runtime)
        assert (EXAMPLES / "repos" / f"{task.metadata['repo']}.solution.patch").is_file()


def test_upload_paths_resolve_against_the_task_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a cwd where `repos/...` does not exist
    for task in load_tasks(EXAMPLES / "tasks.yaml"):
        uploads = [a for a in task.runtime.prepare if isinstance(a, UploadAction)]
        assert uploads and all(Path(a.src).is_absolute() and Path(a.src).is_dir() for a in uploads)


async def _prepare(task: Task, root: Path, name: str) -> LocalRuntime:
    """What a node does in INIT, with the task's own prepare actions."""
    rt = LocalRuntime(RuntimeSpec(root=root, workdir=task.runtime.workdir, env=dict(task.runtime.env)), name)
    await rt.start()
    for action in task.runtime.prepare:
        if isinstance(action, UploadAction):
            await rt.upload(Path(action.src), action.dst)
        else:
            assert isinstance(action, ExecAction)
            res = await rt.exec(action.cmd, timeout_s=action.timeout_seconds)
            assert res.exit_code == 0, res.stderr
    return rt


@pytest.fixture
async def runtimes(tmp_path: Path) -> AsyncIterator[list[LocalRuntime]]:
    made: list[LocalRuntime] = []
    yield made
    for rt in made:
        await rt.stop()


def _ctx(agent: LocalRuntime, fresh: LocalRuntime) -> EvalContext:
    return EvalContext(
        task=None,
        session_id=agent.session_id,
        runtime=agent,
        fresh=fresh,
        agent=ExecResult(0, "", ""),
        trajectory=Trajectory(),
    )


@pytest.mark.parametrize("task", TASKS, ids=[t.task_id for t in TASKS])
async def test_task_fails_as_shipped_and_the_reference_fix_solves_it(
    task: Task, tmp_path: Path, runtimes: list[LocalRuntime]
) -> None:
    ev = get_evaluator(task.evaluator.strategy, task.evaluator.config)
    assert isinstance(ev, CommandEvaluator)
    agent = await _prepare(task, tmp_path, "agent")
    runtimes.append(agent)

    # The shipped repo's tests fail on assertions (the bug), not on an import or syntax error.
    base = await agent.exec("python3 -m unittest", timeout_s=60)  # what the instruction says to run
    assert base.exit_code != 0
    assert "FAILED (failures=" in base.stderr, base.stderr

    # An agent that changes nothing earns nothing.
    fresh = await _prepare(task, tmp_path, "fresh-0")
    runtimes.append(fresh)
    assert (await ev.evaluate(_ctx(agent, fresh))).details == {"reason": "no changes"}

    # The reference fix, applied in the agent's runtime as an agent would, passes in a fresh runtime.
    patch = (EXAMPLES / "repos" / f"{task.metadata['repo']}.solution.patch").read_bytes()
    applied = await agent.exec(["git", "apply", "-"], stdin=patch, timeout_s=60)
    assert applied.exit_code == 0, applied.stderr
    fresh = await _prepare(task, tmp_path, "fresh-1")
    runtimes.append(fresh)
    result = await ev.evaluate(_ctx(agent, fresh))
    assert result.reward == 1.0 and result.passed is True, result.details


@pytest.mark.parametrize("task", TASKS[:1], ids=[TASKS[0].task_id])
async def test_editing_the_tests_does_not_pay(
    task: Task, tmp_path: Path, runtimes: list[LocalRuntime]
) -> None:
    ev = get_evaluator(task.evaluator.strategy, task.evaluator.config)
    agent = await _prepare(task, tmp_path, "agent")
    fresh = await _prepare(task, tmp_path, "fresh")
    runtimes += [agent, fresh]
    # Reward hacking: replace the failing tests by one that always passes, instead of fixing the bug.
    for test in (agent.workdir / "tests").glob("test_*.py"):
        test.write_text(
            "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
        )
    assert (await agent.exec("python3 -m unittest", timeout_s=60)).exit_code == 0
    result = await ev.evaluate(_ctx(agent, fresh))
    assert result.reward == 0.0 and result.details["reason"].startswith("refused: tests/"), result.details
    assert {f["why"] for f in result.details["refused"]} == {"touches a protected path"}


def _fixed_files(task: Task, tmp: Path) -> dict[str, str]:
    """The files the reference fix changes, with their fixed content (what an agent would write)."""
    repo = EXAMPLES / "repos" / task.metadata["repo"]
    patch = repo.with_name(f"{repo.name}.solution.patch")
    work = tmp / f"solved-{repo.name}"
    shutil.copytree(repo, work)
    subprocess.run(["git", "apply", str(patch)], cwd=work, check=True, timeout=60)
    changed = [ln[len("+++ b/") :] for ln in patch.read_text().splitlines() if ln.startswith("+++ b/")]
    return {path: (work / path).read_text() for path in changed}


# One task on every run; the rest with the slow tests (each costs a node start and two agent processes).
NODE_CASES = [
    pytest.param(t, id=t.task_id, marks=() if i == 0 else pytest.mark.slow) for i, t in enumerate(TASKS)
]


@pytest.mark.parametrize("task", NODE_CASES)
async def test_task_through_a_node_with_the_builtin_agent(task: Task, tmp_path: Path) -> None:
    """The whole path offline: a node runs the example task with the built-in agent, played by the fake
    policy (first sample writes the reference fix, second gives up at once); rewards 1 and 0."""
    writes = [
        Reply(tool_calls=[("write_file", json.dumps({"path": path, "content": text}))])
        for path, text in _fixed_files(task, tmp_path).items()
    ]
    scripts = [
        [*writes, Reply(tool_calls=[("finish", '{"summary": "fixed"}')])],
        [Reply(tool_calls=[("finish", '{"summary": "nothing to do"}')])],
    ]
    with fake_policy() as (url, fake):
        async with running_node(url, tmp_path, upload_roots=(EXAMPLES,)) as node:  # as `polar run` does
            results = []
            for i, script in enumerate(scripts):
                fake.reset(script)
                sid = f"{task.task_id}-{i}"
                await node.submit(spec(task, sid, sample_index=i))
                results.append(await node.wait(sid))
    solved, idle = results
    assert solved.status == SessionStatus.COMPLETED, solved.reason
    assert solved.reward == 1.0, solved.metadata.get("evaluation")
    traj = Trajectory.model_validate(solved.trajectory)
    assert traj.traces and all(t.reward == 1.0 for t in traj.traces)
    assert solved.metadata["group_id"] == task.metadata["group_id"]
    assert idle.status == SessionStatus.COMPLETED and idle.reward == 0.0
    assert Trajectory.model_validate(idle.trajectory).metadata["evaluation"]["details"] == {
        "reason": "no changes"
    }
