# ruff: noqa: F811  (`make_repo` is a fixture imported from tests.evaluate_support)
"""Harbor-format task directories: loaded into tasks (examples/swe/harbor), graded by their own test.sh.

The example task's image is built here from its environment/Dockerfile on the local SWE base (no
registry); the agent's runtime and the separate verifier's fresh one are real containers of it. What is
proven: every task.toml field polar maps lands in the task; mistakes name the file, line and key; the
reference solution earns 1 and no change 0 in both verifier modes; a verifier that hangs or writes no
reward earns 0 with the reason; an agent that doctors /tests, pre-writes reward.txt and leaves a process
rewriting it gains nothing in shared mode; a container gone from under the verifier is an evaluator error.
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from polar.evaluate.harbor import HarborEvaluator, parse_reward
from polar.evaluate.registry import fresh_runtime_wanted, get_evaluator
from polar.evaluate.support import EvaluatorError
from polar.rollout.harbor import environment_hash, parse_size_mb
from polar.rollout.taskfile import TaskFileError, load_tasks
from polar.runtime import RuntimeSpec, make_runtime
from polar.runtime.base import Runtime
from polar.runtime.images import DEFAULT_INCLUDE, BaseImage, ensure_base_image
from polar.task import Task
from tests.evaluate_support import context, make_repo  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "swe" / "harbor" / "fix-word-count"
SWE_BASE = BaseImage(tag="polar-swe-base:bookworm", include=(*DEFAULT_INCLUDE, "python3-pytest"))

TOML = """\
version = "1.0"

[verifier]
timeout_sec = 30.0
environment_mode = "separate"
env = {LEVEL = "strict"}

[agent]
timeout_sec = 90

[environment]
docker_image = "polar-base:bookworm"
workdir = "/work"
cpus = 2
memory = "2G"
allow_internet = false
env = {LANG = "C.UTF-8"}
"""


def harbor_dir(root: Path, name: str, toml: str = TOML, **files: str) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_text(toml)
    (d / "instruction.md").write_text(files.pop("instruction", "Write /work/out.txt.\n"))
    (d / "tests" / "test.sh").write_text(files.pop("test", "echo 1 > /logs/verifier/reward.txt\n"))
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def load_one(root: Path, extra: str = "") -> Task:
    (root / "tasks.yaml").write_text(f"dataset:\n  format: harbor\n  path: ds\n{extra}")
    (task,) = load_tasks(root / "tasks.yaml")
    return task


def test_the_example_dataset_becomes_tasks() -> None:
    (task,) = load_tasks(ROOT / "examples" / "swe" / "harbor.yaml")
    assert task.task_id == "fix-word-count"
    assert task.instruction == (EXAMPLE / "instruction.md").read_text()
    rt = task.runtime
    assert rt.image == f"polar-harbor-fix-word-count:{environment_hash(EXAMPLE / 'environment')}"
    assert rt.build is not None and Path(rt.build.context) == EXAMPLE / "environment"
    assert rt.build.dockerfile == "Dockerfile"
    assert (rt.backend, rt.workdir, rt.network) == ("docker", "/app", "gateway")  # WORKDIR of the Dockerfile
    assert (rt.cpus, rt.memory_mb) == (1.0, 1024)
    assert task.agent.budget_seconds == 600.0 and task.num_samples == 2  # [agent]; `defaults`
    ev = task.evaluator
    assert ev.strategy == "harbor" and ev.timeout_seconds > 120.0
    cfg = ev.config
    assert (cfg["environment_mode"], cfg["timeout_seconds"], cfg["artifacts"]) == ("shared", 120.0, ["/app"])
    tests = {f["path"]: f for f in cfg["tests"]}
    assert sorted(tests) == ["test.sh", "test_wordcount.py"]
    assert base64.b64decode(tests["test.sh"]["data"]) == (EXAMPLE / "tests" / "test.sh").read_bytes()
    assert tests["test.sh"]["mode"] & 0o100
    assert task.metadata["harbor_network_mode"] == "no-network"
    evaluator = get_evaluator("harbor", cfg)
    assert not fresh_runtime_wanted(evaluator, ev.fresh_runtime)
    assert fresh_runtime_wanted(get_evaluator("harbor", {**cfg, "environment_mode": "separate"}), None)


@pytest.mark.containers  # a task naming podman loads only where the podman CLI is (factory.check_runtime)
def test_every_mapped_field_of_a_task_toml(tmp_path: Path) -> None:
    harbor_dir(tmp_path / "ds", "one")
    harbor_dir(tmp_path / "ds", "two")
    (tmp_path / "ds" / "README.md").write_text("not a task")
    task = load_one(tmp_path, "  ids: [one]\ndefaults:\n  runtime: {backend: podman}\n")
    rt = task.runtime
    assert (rt.image, rt.build, rt.workdir) == ("polar-base:bookworm", None, "/work")
    assert (rt.backend, rt.cpus, rt.memory_mb, rt.env) == ("podman", 2.0, 2048, {"LANG": "C.UTF-8"})
    assert task.agent.budget_seconds == 90
    cfg = task.evaluator.config
    assert (cfg["environment_mode"], cfg["timeout_seconds"], cfg["env"]) == (
        "separate",
        30.0,
        {"LEVEL": "strict"},
    )
    assert task.metadata["harbor_network_mode"] == "no-network"  # allow_internet = false
    # `path` may name one task directory
    (tmp_path / "tasks.yaml").write_text("dataset: {format: harbor, path: ds/two}\n")
    assert [t.task_id for t in load_tasks(tmp_path / "tasks.yaml")] == ["two"]


@pytest.mark.parametrize(
    ("toml", "error"),
    [
        ("[verifier]\ntimeout_sec = \n", "task.toml:2: not valid TOML"),
        ('version = "1.0"\n\n[verifier]\ntimeout_sec = "soon"\n', "task.toml:4: verifier.timeout_sec: "),
        ("[agent]\ntimeout_sec = -1\n", "task.toml:2: agent.timeout_sec: "),
        ("[environment]\ngpus = 1\n", "task.toml:2: environment.gpus: GPUs are not supported"),
        ('[environment]\nmemory = "lots"\n', "task.toml:2: environment.memory: 'lots' is not a size"),
        ('[verifier]\nenvironment_mode = "both"\n', "task.toml:2: verifier.environment_mode: "),
        (
            '[verifier.environment]\ndocker_image = "x"\n',
            "task.toml:1: verifier.environment: a verifier image",
        ),
        ('[verifier]\nenv = {KEY = "${OPENAI_API_KEY}"}\n', "verifier.env: KEY: ${VAR} templates"),
        ('[environment]\nworkdir = "app"\n', "task.toml:2: environment.workdir: must be an absolute path"),
    ],
)
def test_task_toml_mistakes_name_the_file_line_and_key(tmp_path: Path, toml: str, error: str) -> None:
    d = harbor_dir(tmp_path / "ds", "bad", toml)
    (d / "environment").mkdir()
    (d / "environment" / "Dockerfile").write_text("FROM polar-base:bookworm\n")
    with pytest.raises(TaskFileError) as exc:
        load_one(tmp_path)
    assert f"{d / error}" in str(exc.value) if error.startswith("task.toml") else error in str(exc.value)


def test_missing_files_and_bad_datasets(tmp_path: Path) -> None:
    d = harbor_dir(tmp_path / "ds", "t", "")
    with pytest.raises(TaskFileError, match=r"environment/Dockerfile: missing, and task.toml names no"):
        load_one(tmp_path)
    (d / "instruction.md").unlink()
    with pytest.raises(TaskFileError, match=rf"{d / 'instruction.md'}: missing"):
        load_one(tmp_path)
    (tmp_path / "bad.yaml").write_text("dataset:\n  format: harbour\n  path: ds\n")
    with pytest.raises(TaskFileError, match=r"bad.yaml:2: dataset.format: "):
        load_tasks(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("dataset:\n  format: harbor\n  path: nowhere\n")
    with pytest.raises(TaskFileError, match=r"bad.yaml:3: dataset.path: .*not a directory of Harbor tasks"):
        load_tasks(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("dataset:\n  format: harbor\n  path: ds\n  ids: [nope]\n")
    with pytest.raises(TaskFileError, match=r"bad.yaml:4: dataset.ids: not in ds: nope"):
        load_tasks(tmp_path / "bad.yaml")


def test_sizes_and_reward_files() -> None:
    assert (parse_size_mb("2G"), parse_size_mb("512M"), parse_size_mb("2048K"), parse_size_mb("1.5g")) == (
        2048, 512, 2, 1536
    )  # fmt: skip
    assert parse_size_mb("lots") is None and parse_size_mb("0M") is None
    assert parse_reward("reward.txt", "1\n")[0] == 1.0
    assert parse_reward("reward.txt", "0.25")[0] == 0.25
    assert parse_reward("reward.txt", "")[:2] == (None, "reward.txt is empty")
    assert parse_reward("reward.txt", "yes")[0] is None
    assert parse_reward("reward.json", '{"reward": 0.5, "tests": 3, "note": "x"}') == (
        0.5, "reward.json", {"reward": 0.5, "tests": 3.0}
    )  # fmt: skip
    assert parse_reward("reward.json", '{"accuracy": 0.75}')[0] == 0.75
    assert parse_reward("reward.json", '{"a": 1, "b": 0}')[0] is None


# -- graded in real containers -------------------------------------------------------------------------


def _build(engine: str, tag: str, context: Path) -> str:
    if subprocess.run([engine, "image", "inspect", tag], capture_output=True).returncode != 0:
        subprocess.run(
            [engine, "build", "-q", "-t", tag, str(context)], check=True, capture_output=True, timeout=600
        )
    return tag


@pytest.fixture(scope="module")
def example(docker_engine: str) -> Iterator[Task]:
    """The example task, its image built from environment/ on the local SWE base (cached by the engine)."""
    ensure_base_image(docker_engine, SWE_BASE)
    (task,) = load_tasks(ROOT / "examples" / "swe" / "harbor.yaml")
    assert task.runtime.image is not None and task.runtime.build is not None
    _build(docker_engine, task.runtime.image, Path(task.runtime.build.context))
    yield task


async def _runtime(task: Task, tmp_path: Path, name: str, backend: str = "docker") -> Runtime:
    assert task.runtime.image is not None
    spec = RuntimeSpec(
        backend=backend,  # type: ignore[arg-type]
        image=task.runtime.image,
        workdir=task.runtime.workdir,
        network="none",
        root=tmp_path,
    )
    rt = make_runtime(spec, name)
    await rt.start()
    return rt


@pytest.fixture
async def pair(example: Task, tmp_path: Path) -> AsyncIterator[tuple[Runtime, Runtime]]:
    """(the agent's runtime, a fresh one for a separate verifier)."""
    agent, fresh = await _runtime(example, tmp_path, "agent"), await _runtime(example, tmp_path, "fresh")
    try:
        yield agent, fresh
    finally:
        await agent.stop()
        await fresh.stop()


async def solve(agent: Runtime, task_dir: Path = EXAMPLE) -> None:
    """What Harbor's oracle agent does: run solution/solve.sh in the agent's container."""
    await agent.upload(task_dir / "solution", "/solution")
    done = await agent.exec(["bash", "/solution/solve.sh"], timeout_s=60)
    assert done.exit_code == 0, done.stderr


async def grade(task: Task, pair: tuple[Runtime, Runtime], **config: Any) -> Any:
    agent, fresh = pair
    evaluator = HarborEvaluator({**task.evaluator.config, **config})
    return await evaluator.evaluate(context(agent, fresh if evaluator.needs_fresh_runtime else None))


@pytest.mark.containers
@pytest.mark.parametrize("mode", ["shared", "separate"])
async def test_the_solution_earns_1_and_no_change_0(
    example: Task, pair: tuple[Runtime, Runtime], mode: str
) -> None:
    before = await grade(example, pair, environment_mode=mode)
    assert (before.reward, before.passed) == (0.0, False), before.details
    assert before.details["reason"] == "reward.txt: 0" and "failed" in before.details["output"]
    await solve(pair[0])
    after = await grade(example, pair, environment_mode=mode)
    assert (after.reward, after.passed) == (1.0, True), after.details
    assert after.details["rewards"] == {"reward": 1.0}
    if mode == "separate":
        assert after.details["artifacts"] == ["/app"]  # the agent's /app, copied into the fresh container
        fixed = await pair[1].exec(["grep", "-c", "text.split()", "/app/wordcount.py"])
        assert fixed.stdout.strip() == "1"


@pytest.mark.containers
async def test_separate_mode_gets_only_the_artifacts(example: Task, pair: tuple[Runtime, Runtime]) -> None:
    await solve(pair[0])
    result = await grade(example, pair, environment_mode="separate", artifacts=[])
    assert result.reward == 0.0, result.details  # /app was not declared: the fresh one keeps the bug
    await pair[0].exec("mkdir -p /logs/artifacts && echo kept > /logs/artifacts/note.txt")
    result = await grade(example, pair, environment_mode="separate", artifacts=[])
    assert result.details["artifacts"] == ["/logs/artifacts"]
    assert (await pair[1].exec(["cat", "/logs/artifacts/note.txt"])).stdout == "kept\n"


def _tests(**files: str) -> list[dict[str, Any]]:
    return [
        {"path": p, "mode": 0o755, "data": base64.b64encode(t.encode()).decode()} for p, t in files.items()
    ]


@pytest.mark.containers
async def test_a_verifier_past_its_timeout_earns_0(example: Task, pair: tuple[Runtime, Runtime]) -> None:
    await solve(pair[0])
    slow = _tests(**{"test.sh": "sleep 60\necho 1 > /logs/verifier/reward.txt\n"})
    result = await grade(example, pair, tests=slow, timeout_seconds=1)
    assert result.reward == 0.0 and result.details["reason"] == "the verifier timed out after 1 s"


@pytest.mark.containers
@pytest.mark.parametrize(
    ("script", "reason"),
    [
        ("echo all good\nexit 0\n", "the verifier wrote no /logs/verifier/reward.txt or reward.json"),
        ("echo > /logs/verifier/reward.txt\n", "reward.txt is empty"),
        (
            'echo \'{"passed": 1, "total": 3}\' > /logs/verifier/reward.json\n',
            "reward.json has no 'reward' key",
        ),
    ],
)
async def test_a_verifier_without_a_usable_reward_earns_0(
    example: Task, pair: tuple[Runtime, Runtime], script: str, reason: str
) -> None:
    result = await grade(example, pair, tests=_tests(**{"test.sh": script}))
    assert result.reward == 0.0 and result.details["reason"].startswith(reason), result.details


@pytest.mark.containers
async def test_reward_json_wins_over_reward_txt(example: Task, pair: tuple[Runtime, Runtime]) -> None:
    script = "echo 0 > /logs/verifier/reward.txt\necho '{\"reward\": 0.5}' > /logs/verifier/reward.json\n"
    result = await grade(example, pair, tests=_tests(**{"test.sh": script}), env={"X": "1"})
    assert result.reward == 0.5 and result.details["reason"] == "reward.json: 0.5"


@pytest.mark.containers
async def test_an_agent_cannot_raise_its_reward_in_shared_mode(
    example: Task, pair: tuple[Runtime, Runtime]
) -> None:
    agent = pair[0]
    tamper = (
        "mkdir -p /tests /logs/verifier && "
        "printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh && "
        "echo 1 > /logs/verifier/reward.txt && "
        # a process left behind that keeps writing a reward of 1
        "setsid bash -c 'while true; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
        "sleep 0.05; done' > /dev/null 2>&1 < /dev/null &"
    )
    done = await agent.exec(tamper, timeout_s=30)
    assert done.exit_code == 0, done.stderr
    # The loop truncates, then writes: a read may land in between, so read until it sees the 1.
    seen = [(await agent.exec(["cat", "/logs/verifier/reward.txt"])).stdout for _ in range(20)]
    assert any("1" in text for text in seen), seen
    result = await grade(example, pair)
    assert (result.reward, result.details["reason"]) == (0.0, "reward.txt: 0"), result.details
    left = await agent.exec(["bash", "-c", "ps -eo args | grep -c '[w]hile true'"])
    assert left.stdout.strip() == "0"  # the leftover process is gone
    assert (await agent.exec(["cat", "/logs/verifier/reward.txt"])).stdout == "0\n"


@pytest.mark.containers
async def test_a_container_gone_from_under_the_verifier_is_an_evaluator_error(
    example: Task, pair: tuple[Runtime, Runtime]
) -> None:
    agent = pair[0]
    subprocess.run(["docker", "rm", "-f", agent.session_dir.name], check=True, capture_output=True)
    with pytest.raises(EvaluatorError):
        await grade(example, pair)


@pytest.mark.containers
async def test_a_harbor_task_on_podman(podman_engine: str, tmp_path: Path) -> None:
    """A task of its own on polar's base (podman has no SWE base here): load, build, solve, verify."""
    toml = '[verifier]\ntimeout_sec = 60\n\n[environment]\nnetwork_mode = "public"\n'
    d = harbor_dir(
        tmp_path / "ds",
        "greet",
        toml,
        test="grep -qx hello /srv/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
        **{
            "environment/Dockerfile": "FROM polar-base:bookworm\nWORKDIR /srv\n",
            "solution/solve.sh": "echo hello > /srv/out.txt\n",
        },
    )
    task = load_one(tmp_path, "defaults:\n  runtime: {backend: podman}\n")
    assert task.runtime.workdir == "/srv" and task.metadata["harbor_network_mode"] == "public"
    assert task.runtime.image is not None and task.runtime.build is not None
    _build(podman_engine, task.runtime.image, Path(task.runtime.build.context))
    agent = await _runtime(task, tmp_path, "agent", "podman")
    try:
        zero = await HarborEvaluator(task.evaluator.config).evaluate(context(agent))
        await solve(agent, d)
        one = await HarborEvaluator(task.evaluator.config).evaluate(context(agent))
    finally:
        await agent.stop()
        subprocess.run([podman_engine, "rmi", "-f", task.runtime.image], capture_output=True)
    assert (zero.reward, one.reward) == (0.0, 1.0), (zero.details, one.details)


async def test_a_runtime_that_is_not_a_container_is_an_evaluator_error(make_repo: Any) -> None:
    runtime = await make_repo({"a.txt": "x"}, git=False, backend="local")
    config = {"tests": _tests(**{"test.sh": "echo 1 > /logs/verifier/reward.txt\n"})}
    with pytest.raises(EvaluatorError, match="needs a docker or podman runtime, not 'local'"):
        await HarborEvaluator(config).evaluate(context(runtime))
