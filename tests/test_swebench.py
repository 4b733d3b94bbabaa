"""SWE-bench-format tasks: the offline suite in examples/swe, graded by the official swebench package.

The instances (examples/swe/instances.jsonl, written by make_instances.py) live in an image built here
from the local base (no registry): the agent's runtime and the evaluator's fresh runtime are real docker
containers of it. What is proven: the gold patch resolves each instance; an empty diff, a fix that breaks
a PASS_TO_PASS test, and an agent that edits the tests it is judged by do not; a dataset file becomes tasks.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from polar.evaluate.registry import get_evaluator
from polar.evaluate.swebench import SWEBenchEvaluator, patched_files
from polar.rollout.taskfile import TaskFileError, load_tasks
from polar.runtime import RuntimeSpec, make_runtime
from polar.runtime.base import Runtime, RuntimeFailure
from polar.runtime.images import DEFAULT_INCLUDE, BaseImage, build_image, ensure_base_image
from tests.evaluate_support import context

ROOT = Path(__file__).resolve().parent.parent
SWE = ROOT / "examples" / "swe"
INSTANCES = {d["instance_id"]: d for d in map(json.loads, (SWE / "instances.jsonl").read_text().splitlines())}
SWE_BASE = BaseImage(tag="polar-swe-base:bookworm", include=(*DEFAULT_INCLUDE, "python3-pytest"))
IMAGE = "polar-swe-textstats:1"


def test_instances_are_what_the_script_writes() -> None:
    done = subprocess.run(
        ["python3", str(SWE / "make_instances.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.containers  # a task naming podman loads only where the podman CLI is (factory.check_runtime)
def test_a_dataset_file_becomes_tasks(tmp_path: Path) -> None:
    tasks = load_tasks(SWE / "swe.yaml")
    assert [t.task_id for t in tasks] == list(INSTANCES)
    t = tasks[0]
    inst = INSTANCES[t.task_id]
    assert t.instruction == inst["problem_statement"]
    assert (t.runtime.backend, t.runtime.image, t.runtime.workdir) == ("docker", IMAGE, "/testbed")
    assert t.num_samples == 2 and t.runtime.network == "gateway"  # from `defaults`
    assert t.evaluator.strategy == "swebench"
    assert t.runtime.build is not None  # the instance's `build`, its context relative to the dataset file
    assert Path(t.runtime.build.context) == SWE / "repos/textstats"
    assert (Path(t.runtime.build.context) / t.runtime.build.dockerfile).resolve() == (
        SWE / "images/textstats/Dockerfile"
    )
    cfg = t.evaluator.config["instance"]
    assert cfg["FAIL_TO_PASS"] == inst["FAIL_TO_PASS"] and "patch" not in cfg  # no gold patch in the task
    assert isinstance(get_evaluator("swebench", t.evaluator.config), SWEBenchEvaluator)

    (tmp_path / "instances.jsonl").write_text((SWE / "instances.jsonl").read_text())
    only = tmp_path / "one.yaml"
    only.write_text(
        "dataset:\n  format: swebench\n  path: instances.jsonl\n  ids: [polar-swe__textstats-2]\n"
        "defaults:\n  runtime: {backend: podman, workdir: /srv}\n"
    )
    (task,) = load_tasks(only)
    assert task.task_id == "polar-swe__textstats-2" and task.runtime.backend == "podman"
    assert task.runtime.workdir == "/srv"  # defaults win over what an instance gives


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("dataset:\n  format: swebench\n  path: nowhere.jsonl\n", "bad.yaml:3: dataset.path: "),
        ("dataset:\n  format: swe\n  path: instances.jsonl\n", "bad.yaml:2: dataset.format: "),
        (
            "dataset:\n  format: swebench\n  path: instances.jsonl\n  ids: [nope]\n",
            "bad.yaml:4: dataset.ids: not in",
        ),
        (
            "dataset:\n  format: swebench\n  path: instances.jsonl\ndefault: {}\n",
            "bad.yaml:4: default: unknown key",
        ),
        (
            "dataset:\n  format: swebench\n  path: instances.jsonl\ndefaults:\n  num_samples: 0\n",
            "bad.yaml:5: dataset instance polar-swe__textstats-1: num_samples: ",
        ),
    ],
)
def test_dataset_mistakes_name_the_line_and_field(tmp_path: Path, text: str, error: str) -> None:
    (tmp_path / "instances.jsonl").write_text((SWE / "instances.jsonl").read_text())
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(TaskFileError) as exc:
        load_tasks(tmp_path / "bad.yaml")
    assert error in str(exc.value)


def _task_repo(tmp_path: Path, iid: str) -> Path:
    """A SWE-bench 5.x task repo (swebench.task.repo's layout) with one instance's Dockerfile, on the
    ubuntu base SWE-bench's images start from."""
    folder = tmp_path / "swe-bench-tasks" / "tasks" / iid
    folder.mkdir(parents=True)
    (folder / "task.yaml").write_text(f"instance_id: {iid}\n")
    (folder / "Dockerfile").write_text("FROM ubuntu:22.04\nRUN apt-get update && apt-get install -y git\n")
    return folder


def test_a_task_repo_gives_the_instances_their_dockerfiles(tmp_path: Path) -> None:
    from swebench.task.repo import task_paths

    row = {k: v for k, v in INSTANCES["polar-swe__textstats-1"].items() if k not in ("image", "build")}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text(json.dumps(row) + "\n")
    folder = _task_repo(tmp_path, row["instance_id"])
    (tmp_path / "t.yaml").write_text(
        "dataset:\n  format: swebench\n  path: data/rows.jsonl\n  task_repo: swe-bench-tasks\n"
    )
    (task,) = load_tasks(tmp_path / "t.yaml")
    assert task.runtime.image == "swebench/sweb.eval.x86_64.polar-swe_1776_textstats-1:latest"
    assert task.runtime.build is not None and task.runtime.build.dockerfile == "Dockerfile"
    # The directory swebench itself builds the instance's image in.
    assert (
        Path(task.runtime.build.context)
        == folder
        == task_paths(tmp_path / "swe-bench-tasks")[row["instance_id"]]
    )

    (tmp_path / "t.yaml").write_text(
        "dataset:\n  format: swebench\n  path: data/rows.jsonl\n  task_repo: elsewhere\n"
    )
    with pytest.raises(
        TaskFileError, match=r"t.yaml:4: dataset.task_repo: no .*/elsewhere/tasks/polar-swe__"
    ):
        load_tasks(tmp_path / "t.yaml")


@pytest.mark.containers
def test_a_task_repo_image_offline_says_which_base_is_missing(docker_engine: str, tmp_path: Path) -> None:
    """Here no registry answers: the build stops before docker tries one, naming the base to provide."""
    iid = "polar-swe__textstats-1"
    folder = _task_repo(tmp_path, iid)
    tag = "sweb.eval.x86_64.polar-swe__textstats-1:latest"
    with pytest.raises(RuntimeFailure) as exc:
        build_image(docker_engine, tag, folder)
    assert f"cannot build {tag}: its base image ubuntu:22.04 (FROM in {folder}/Dockerfile)" in str(exc.value)
    assert "docker pull ubuntu:22.04` where a registry is reachable" in str(exc.value)


def test_the_files_a_test_patch_touches() -> None:
    patch = INSTANCES["polar-swe__textstats-1"]["test_patch"]
    assert patched_files(patch) == ["tests/test_textstats.py"]
    new_file = "diff --git a/t/new.py b/t/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/t/new.py\n"
    assert patched_files(patch + new_file) == ["tests/test_textstats.py", "t/new.py"]


# -- graded in real containers -------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["docker", "podman"])
def swe_image(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(engine, the textstats instances' image), built offline on the local SWE base (cached by the engine);
    grading runs on both engines."""
    engine = str(request.getfixturevalue(f"{request.param}_engine"))
    ensure_base_image(engine, SWE_BASE)
    build = load_tasks(SWE / "swe.yaml")[0].runtime.build  # the instances' own `build`
    assert build is not None
    build_image(engine, IMAGE, Path(build.context), build.dockerfile)
    yield engine, IMAGE


async def _runtime(tmp_path: Path, name: str, engine: str) -> Runtime:
    spec = RuntimeSpec(backend=engine, image=IMAGE, workdir="/testbed", network="none", root=tmp_path)  # type: ignore[arg-type]
    rt = make_runtime(spec, name)
    await rt.start()
    return rt


@pytest.fixture
async def pair(swe_image: tuple[str, str], tmp_path: Path) -> AsyncIterator[tuple[Runtime, Runtime]]:
    """(the agent's runtime, the evaluator's fresh one), both at the instance's base commit."""
    engine = swe_image[0]
    agent, fresh = await _runtime(tmp_path, "agent", engine), await _runtime(tmp_path, "fresh", engine)
    try:
        yield agent, fresh
    finally:
        await agent.stop()
        await fresh.stop()


async def grade(pair: tuple[Runtime, Runtime], iid: str, agent_edit: str | None) -> Any:
    agent, fresh = pair
    inst = INSTANCES[iid]
    head = await agent.exec(["git", "rev-parse", "HEAD"])
    assert head.stdout.strip() == inst["base_commit"]  # the image's commit is the instance's
    if agent_edit is not None:
        done = await agent.exec(agent_edit)
        assert done.exit_code == 0, done.stderr
    evaluator = SWEBenchEvaluator({"instance": {k: v for k, v in inst.items() if k != "patch"}})
    return await evaluator.evaluate(context(agent, fresh))


def _apply(patch: str) -> str:
    return f"git apply - <<'EOF'\n{patch}EOF"


@pytest.mark.containers
@pytest.mark.parametrize("iid", list(INSTANCES))
async def test_the_gold_patch_resolves_the_instance(pair: tuple[Runtime, Runtime], iid: str) -> None:
    result = await grade(pair, iid, _apply(INSTANCES[iid]["patch"]))
    assert result.reward == 1.0 and result.passed, result.details
    status = result.details["tests_status"]
    assert status["FAIL_TO_PASS"]["success"] == INSTANCES[iid]["FAIL_TO_PASS"]
    assert sorted(status["PASS_TO_PASS"]["success"]) == sorted(INSTANCES[iid]["PASS_TO_PASS"])
    assert result.details["applied_with"] == "git apply"


@pytest.mark.containers
async def test_no_changes_is_not_resolved(pair: tuple[Runtime, Runtime]) -> None:
    result = await grade(pair, "polar-swe__textstats-1", None)
    assert result.reward == 0.0 and result.details["reason"] == "no changes"


@pytest.mark.containers
async def test_a_fix_that_breaks_a_passing_test_is_not_resolved(pair: tuple[Runtime, Runtime]) -> None:
    """word_count fixed, mean_word_length broken on the way: FAIL_TO_PASS passes, PASS_TO_PASS does not."""
    edit = (
        "python3 - <<'EOF'\n"
        "p = 'textstats/__init__.py'\n"
        "s = open(p).read().replace('text.split(\" \")', 'text.split()')\n"
        "s = s.replace('/ len(ws)', '/ (len(ws) + 1)')\n"
        "open(p, 'w').write(s)\n"
        "EOF"
    )
    result = await grade(pair, "polar-swe__textstats-1", edit)
    assert result.reward == 0.0 and result.details["reason"] == "not resolved", result.details
    status = result.details["tests_status"]
    assert status["FAIL_TO_PASS"]["success"] == ["tests/test_textstats.py::test_word_count_extra_spaces"]
    assert status["PASS_TO_PASS"]["failure"] == ["tests/test_textstats.py::test_mean_word_length"]


@pytest.mark.containers
async def test_editing_the_tests_cannot_make_them_pass(pair: tuple[Runtime, Runtime]) -> None:
    """The agent rewrites the test file the instance's test_patch touches so everything passes: the file
    never leaves its runtime (the diff excludes it), and the verdict is the real tests'."""
    edit = (
        "cat > tests/test_textstats.py <<'EOF'\n"
        "def test_word_count_extra_spaces():\n    pass\n\n\ndef test_word_count_simple():\n    pass\n"
        "EOF\n"
        "echo '# touched' >> README.md"
    )
    result = await grade(pair, "polar-swe__textstats-1", edit)
    assert result.reward == 0.0 and result.details["reason"] == "not resolved", result.details
    assert result.details["tests_status"]["FAIL_TO_PASS"]["failure"] == [
        "tests/test_textstats.py::test_word_count_extra_spaces"
    ]


@pytest.mark.containers
async def test_a_log_past_the_output_cap_is_graded_whole(pair: tuple[Runtime, Runtime]) -> None:
    """A test suite that prints more than a command's captured output keeps (10 MiB, the head) before its
    results: the grade still sees the `End Test Output` marker, because the log is fetched as a file."""
    from polar.runtime.procs import OUTPUT_CAP

    agent, fresh = pair
    inst = dict(INSTANCES["polar-swe__textstats-1"])
    noise = f"head -c {OUTPUT_CAP + 1_000_000} /dev/zero | tr '\\0' 'x'; echo\n"
    inst["eval_script"] = inst["eval_script"].replace("#!/bin/bash\n", "#!/bin/bash\n" + noise, 1)
    assert (await agent.exec(_apply(inst["patch"]))).exit_code == 0
    evaluator = SWEBenchEvaluator({"instance": {k: v for k, v in inst.items() if k != "patch"}})
    result = await evaluator.evaluate(context(agent, fresh))
    assert result.reward == 1.0, result.details.get("reason")
    assert "End Test Output" in result.details["eval_log"]
