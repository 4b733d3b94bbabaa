"""Published rows graded in real docker containers, offline: a SWE-bench row as published (its test spec
built by swebench 4.1.0), a SWE-smith row (the bug built from its patch, swesmith's profile command and rule)
and an R2E-Gym row (hidden tests, run_tests.sh, exact match). For each: the fix earns 1, no change 0, and an
agent that rewrites the tests 0. One image (tests/test_swebench.py's textstats image), with R2E-Gym's files
layered on it for its row."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from polar.evaluate.swebench import SWEBenchEvaluator
from polar.rollout.taskfile import load_tasks
from polar.runtime import RuntimeSpec, make_runtime
from polar.runtime.base import Runtime
from polar.runtime.images import build_image, ensure_base_image
from polar.task import Task
from tests.evaluate_support import context
from tests.published_rows import (
    R2E_DOCKERFILE,
    R2E_IMAGE,
    R2E_RUN_TESTS,
    R2E_TESTS,
    SWE,
    SWEBENCH_SPECS,
    SWESMITH_SPECS,
    r2e_row,
    swebench_row,
    swesmith_row,
    write_jsonl,
)
from tests.test_swebench import IMAGE, SWE_BASE

pytestmark = pytest.mark.containers
IID = "polar-swe__textstats-1"
SOURCE = (SWE / "repos/textstats/textstats/__init__.py").read_text()


@pytest.fixture(scope="module")
def tasks(docker_engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Task]]:
    """The shapes' tasks, and their images built offline (the textstats image, R2E-Gym's files on it)."""
    ensure_base_image(docker_engine, SWE_BASE)
    build = load_tasks(SWE / "swe.yaml", resolve_imports=False)[0].runtime.build
    assert build is not None
    build_image(docker_engine, IMAGE, Path(build.context), build.dockerfile)
    tmp = tmp_path_factory.mktemp("published")
    r2e = tmp / "r2e"
    r2e.mkdir()
    (r2e / "Dockerfile").write_text(R2E_DOCKERFILE)
    (r2e / "test_1.py").write_text(R2E_TESTS)
    (r2e / "run_tests.sh").write_text(R2E_RUN_TESTS)
    build_image(docker_engine, R2E_IMAGE, r2e)
    shapes: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "swebench": (swebench_row(IID), SWEBENCH_SPECS),
        "swesmith": (swesmith_row(SOURCE), SWESMITH_SPECS),
        "r2egym": (r2e_row(), {}),
    }
    found = {}
    for shape, (row, specs) in shapes.items():
        write_jsonl(tmp / f"{shape}.jsonl", [row])
        dataset = {"format": shape, "path": f"{shape}.jsonl", "specs": specs}
        (tmp / f"{shape}.yaml").write_text(f"dataset: {json.dumps(dataset)}\n")
        (task,) = load_tasks(tmp / f"{shape}.yaml", resolve_imports=False)
        found[shape] = task
    yield found


async def _runtime(task: Task, engine: str, root: Path, name: str) -> Runtime:
    image = (
        IMAGE if task.runtime.image == "swebench/sweb.eval.x86_64.polar-swe_1776_textstats-1:latest" else None
    )
    spec = RuntimeSpec(  # type: ignore[arg-type]
        backend=engine, image=image or task.runtime.image, workdir="/testbed", network="none", root=root
    )
    rt = make_runtime(spec, name)
    await rt.start()
    for action in task.runtime.prepare:  # what the node runs before the agent, in both runtimes
        done = await rt.exec(["bash", "-c", action.cmd])  # type: ignore[union-attr]
        assert done.exit_code == 0, done.stderr
    return rt


@pytest.fixture
async def grade(tasks: dict[str, Task], docker_engine: str, tmp_path: Path) -> AsyncIterator[Any]:
    started: list[Runtime] = []

    async def run(shape: str, agent_edit: str | None) -> Any:
        task = tasks[shape]
        agent = await _runtime(task, docker_engine, tmp_path, f"agent{len(started)}")
        fresh = await _runtime(task, docker_engine, tmp_path, f"fresh{len(started)}")
        started.extend([agent, fresh])
        if agent_edit is not None:
            done = await agent.exec(["bash", "-c", agent_edit])
            assert done.exit_code == 0, done.stderr
        return await SWEBenchEvaluator(task.evaluator.config).evaluate(context(agent, fresh))

    yield run
    for rt in started:
        await rt.stop()


def _apply(patch: str, reverse: bool = False) -> str:
    return f"git apply {'-R ' if reverse else ''}- <<'EOF'\n{patch}EOF"


FIXES = {
    "swebench": _apply(swebench_row(IID)["patch"]),
    "swesmith": _apply(swesmith_row(SOURCE)["patch"], reverse=True),  # the fix undoes the bug
    "r2egym": _apply(swebench_row(IID)["patch"]),
}
# Each rewrites the tests it will be judged by so that they pass, and changes nothing else that matters.
TEST_EDITS = {
    "swebench": "printf 'def test_word_count_extra_spaces():\\n    pass\\n' > tests/test_textstats.py",
    "swesmith": "mkdir -p tests && printf 'def test_mean_word_length():\\n    pass\\n' > tests/test_textstats.py",
    "r2egym": "printf 'def test_word_count_extra_spaces():\\n    pass\\n' > r2e_tests/test_1.py"
    " && printf 'echo PASSED r2e_tests/test_1.py::test_word_count_extra_spaces\\n' > /root/run_tests.sh",
}


@pytest.mark.parametrize("shape", ["swebench", "swesmith", "r2egym"])
async def test_a_published_row_grades_fix_1_nothing_0_test_edit_0(grade: Any, shape: str) -> None:
    fixed = await grade(shape, FIXES[shape])
    assert fixed.reward == 1.0 and fixed.details["reason"] == "resolved", fixed.details
    nothing = await grade(shape, None)
    assert nothing.reward == 0.0 and nothing.details["reason"] == "no changes", nothing.details
    edited = await grade(shape, TEST_EDITS[shape] + " && echo '# touched' >> README.md")
    assert edited.reward == 0.0 and edited.details["reason"] == "not resolved", edited.details
