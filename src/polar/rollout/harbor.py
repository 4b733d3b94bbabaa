"""Harbor-format task directories as tasks (`dataset: {format: harbor, path: DIR}`).

A Harbor task (github.com/harbor-framework/harbor, checked against its 0.2x source) is a directory:
`task.toml`, `instruction.md`, `environment/Dockerfile` (or `[environment] docker_image`), `tests/test.sh`
(which writes `/logs/verifier/reward.txt` or `reward.json`) and `solution/solve.sh`. `path` names a folder
whose subdirectories are tasks, or one task directory. Each becomes a task:

- `task_id`: the directory's name; the instruction: `instruction.md`;
- `runtime.image`: `docker_image`, else `polar-harbor-<name>:<hash of environment/>` with `runtime.build`
  naming `environment/` (built by `polar images build`, never by a node);
- `runtime.workdir`: `[environment] workdir`, else the Dockerfile's last absolute `WORKDIR`, else `/`;
- `runtime.cpus` / `memory_mb` / `env` from `[environment]` (`memory = "2G"` as Harbor's deprecated form);
- `runtime.network`: `gateway` whatever Harbor's `network_mode` says (the agent needs the model API and
  nothing else; `public` is recorded in metadata, docs/datasets.md says why);
- `agent.budget_seconds`: `[agent] timeout_sec`;
- the `harbor` evaluator (`polar.evaluate.harbor`) with the verifier's mode, timeout and env, the task's
  declared `artifacts`, and the `tests/` files themselves, carried in the task so the node copies them in
  after the agent from what was read here (the agent never sees them, and no host path travels).

Harbor ignores keys it does not know and so does this loader; what polar cannot honour (GPUs, a separate
verifier image, multi-step tasks, `${VAR}` host variables) is refused with the file, line and key.
"""

from __future__ import annotations

import base64
import hashlib
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from polar.rollout.datasets import DatasetError, DatasetSpec
from polar.rollout.datasets import _merge as merge_defaults

TESTS_LIMIT_BYTES = (
    8 * 1024 * 1024
)  # tests/ travels inside the task; a dataset's fixtures belong in the image
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)I?B?\s*$", re.IGNORECASE)
_TEMPLATE = re.compile(r"\$\{[^}]*\}")


class HarborError(DatasetError):
    """A Harbor task directory that cannot become a task; the message is `file[:line]: key: reason`."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as Harbor: unknown keys are ignored


def _no_templates(env: dict[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if _TEMPLATE.search(value):
            raise ValueError(f"{key}: ${{VAR}} templates read the host's environment; polar does not")
    return env


class HarborVerifier(_Section):
    timeout_sec: float = Field(600.0, gt=0)
    environment_mode: Literal["shared", "separate"] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    environment: dict[str, Any] | None = None

    _env = field_validator("env")(_no_templates)

    @field_validator("environment")
    @classmethod
    def _no_image(cls, v: dict[str, Any] | None) -> None:
        if v is not None:
            raise ValueError(
                "a verifier image of its own is not supported; separate mode runs in a fresh container "
                "of the task's image"
            )
        return None


class HarborAgent(_Section):
    timeout_sec: float | None = Field(None, gt=0)


class HarborEnvironment(_Section):
    docker_image: str | None = Field(None, min_length=1)
    workdir: str | None = None
    cpus: float = Field(1, gt=0)
    memory_mb: int = Field(2048, gt=0)
    memory: str | None = None  # Harbor's deprecated form: "2G", "512M"
    gpus: int = Field(0, ge=0, le=0, description="GPUs are not supported")
    allow_internet: bool = True
    network_mode: Literal["public", "no-network", "allowlist"] | None = None
    env: dict[str, str] = Field(default_factory=dict)

    _env = field_validator("env")(_no_templates)

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path in the image")
        return v

    @field_validator("memory")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None and parse_size_mb(v) is None:
            raise ValueError(f"{v!r} is not a size like '2G' or '512M'")
        return v

    def memory_limit_mb(self) -> int:
        size = parse_size_mb(self.memory) if self.memory is not None else None
        return size if size is not None else self.memory_mb

    def network(self) -> str:
        if self.network_mode is not None:
            return self.network_mode
        return "public" if self.allow_internet else "no-network"


class HarborConfig(_Section):
    version: str | None = None
    schema_version: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: HarborVerifier = Field(default_factory=HarborVerifier)
    agent: HarborAgent = Field(default_factory=HarborAgent)
    environment: HarborEnvironment = Field(default_factory=HarborEnvironment)
    artifacts: list[str | dict[str, Any]] = Field(default_factory=list)
    steps: list[Any] | None = None

    @field_validator("steps")
    @classmethod
    def _single_step(cls, v: list[Any] | None) -> None:
        if v:
            raise ValueError("multi-step tasks are not supported")
        return None


def parse_size_mb(text: str) -> int | None:
    """Harbor's size strings ("2G", "512M", "1024K", as its deprecated `memory` field takes) in MiB."""
    m = _SIZE.match(text)
    if m is None:
        return None
    number, unit = float(m.group(1)), m.group(2).upper()
    factor = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[unit]
    mb = int(number * factor)
    return mb if mb > 0 else None


def _key_line(text: str, loc: tuple[Any, ...]) -> int | None:
    """The line of `[section] key` (or of the `[section.key]` table) in a task.toml, for error messages."""
    if not loc:
        return None
    section, key = (str(loc[0]), str(loc[1])) if len(loc) > 1 else (None, str(loc[0]))
    current: str | None = None
    header_line = None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("["):
            current = stripped.strip("[] ")
            if current == (f"{section}.{key}" if section else key):
                return n
            if current == section:
                header_line = n
        elif current == section and re.match(rf"^{re.escape(key)}\s*=", stripped):
            return n
    return header_line


def read_config(path: Path) -> HarborConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise HarborError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        at = re.search(r"at line (\d+)", str(exc))
        where = f"{path}:{at.group(1)}" if at else str(path)
        raise HarborError(f"{where}: not valid TOML: {str(exc).split(' (at line')[0]}") from None
    try:
        return HarborConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = tuple(err["loc"])
        line = _key_line(text, loc)
        where = f"{path}:{line}" if line else str(path)
        field = ".".join(str(p) for p in loc)
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "less_than_equal" and loc[-1] == "gpus":
            message = "GPUs are not supported"
        raise HarborError(f"{where}: {field}: {message}") from None


def environment_hash(env_dir: Path) -> str:
    """A short hash of every file under `environment/` (names, modes, bytes): the image tag, so an edited
    Dockerfile or build file gets a new tag and `polar images build` rebuilds it."""
    digest = hashlib.sha256()
    for p in sorted(env_dir.rglob("*")):
        if p.is_file():
            digest.update(p.relative_to(env_dir).as_posix().encode() + b"\0")
            digest.update(oct(p.stat().st_mode & 0o777).encode() + b"\0")
            digest.update(p.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def image_name(name: str) -> str:
    slug = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._") or "task"
    return f"polar-harbor-{slug[:100]}"


def dockerfile_workdir(dockerfile: Path) -> str | None:
    """The last absolute `WORKDIR` of a Dockerfile (the image's working directory), if it names one."""
    workdir = None
    for line in dockerfile.read_text(errors="replace").splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0].upper() == "WORKDIR" and parts[1].strip().startswith("/"):
            workdir = parts[1].strip().strip("\"'")
    return workdir


def read_tests(tests_dir: Path) -> list[dict[str, Any]]:
    """tests/ as `[{path, mode, data}]` (data base64), what the evaluator writes to /tests."""
    files, total = [], 0
    for p in sorted(tests_dir.rglob("*")):
        if p.is_symlink() or not p.is_file():
            continue
        data = p.read_bytes()
        total += len(data)
        if total > TESTS_LIMIT_BYTES:
            raise HarborError(
                f"{tests_dir}: more than {TESTS_LIMIT_BYTES // (1024 * 1024)} MiB of tests (they travel in "
                "the task); put large fixtures in the image"
            )
        files.append(
            {
                "path": p.relative_to(tests_dir).as_posix(),
                "mode": p.stat().st_mode & 0o777,
                "data": base64.b64encode(data).decode(),
            }
        )
    return files


def task_dirs(root: Path, spec: DatasetSpec) -> list[Path]:
    if not root.is_dir():
        raise DatasetError(f"dataset.path: {root} is not a directory of Harbor tasks")
    if (root / "task.toml").is_file():
        dirs = [root]
    else:
        dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if spec.ids is not None:
        known = {d.name for d in dirs}
        missing = [i for i in spec.ids if i not in known]
        if missing:
            raise DatasetError(f"dataset.ids: not in {spec.path}: {', '.join(missing)}")
        dirs = [d for d in dirs if d.name in set(spec.ids)]
    if not dirs:
        raise DatasetError(f"dataset.path: no Harbor task directories in {root}")
    return dirs


def harbor_task(task_dir: Path, rel: str) -> dict[str, Any]:
    """One Harbor task directory as a task (a dict; the caller merges `defaults` and validates)."""
    if not (task_dir / "task.toml").is_file():
        raise HarborError(f"{task_dir}: no task.toml (not a Harbor task directory)")
    cfg = read_config(task_dir / "task.toml")
    instruction_path = task_dir / "instruction.md"
    if not instruction_path.is_file():
        raise HarborError(f"{instruction_path}: missing (the task's instruction)")
    instruction = instruction_path.read_text()
    if not instruction.strip():
        raise HarborError(f"{instruction_path}: empty")
    tests_dir = task_dir / "tests"
    if not (tests_dir / "test.sh").is_file():
        raise HarborError(f"{tests_dir / 'test.sh'}: missing (the verifier)")
    env = cfg.environment
    runtime: dict[str, Any] = {
        "backend": "docker",
        "network": "gateway",
        "cpus": float(env.cpus),
        "memory_mb": env.memory_limit_mb(),
    }
    if env.env:
        runtime["env"] = dict(env.env)
    workdir = env.workdir
    if env.docker_image is not None:
        runtime["image"] = env.docker_image
    else:
        dockerfile = task_dir / "environment" / "Dockerfile"
        if not dockerfile.is_file():
            raise HarborError(f"{dockerfile}: missing, and task.toml names no [environment] docker_image")
        runtime["image"] = f"{image_name(task_dir.name)}:{environment_hash(dockerfile.parent)}"
        runtime["build"] = {"context": f"{rel}/environment", "dockerfile": "Dockerfile"}
        workdir = workdir or dockerfile_workdir(dockerfile)
    runtime["workdir"] = workdir or "/"
    verifier = cfg.verifier
    timeout = verifier.timeout_sec
    agent: dict[str, Any] = {}
    if cfg.agent.timeout_sec is not None:
        agent["budget_seconds"] = cfg.agent.timeout_sec
    evaluator_config: dict[str, Any] = {
        "environment_mode": verifier.environment_mode or "shared",  # Harbor's default
        "timeout_seconds": timeout,
        "tests": read_tests(tests_dir),
    }
    if verifier.env:
        evaluator_config["env"] = dict(verifier.env)
    if cfg.artifacts:
        evaluator_config["artifacts"] = list(cfg.artifacts)
    task: dict[str, Any] = {
        "task_id": task_dir.name,
        "instruction": instruction,
        # Room for the agent, the verifier, and starting both runtimes.
        "timeout_seconds": (cfg.agent.timeout_sec or 1800.0) + timeout + 600.0,
        "runtime": runtime,
        "agent": agent,
        "evaluator": {"strategy": "harbor", "timeout_seconds": timeout + 300.0, "config": evaluator_config},
        "metadata": {"dataset": rel, "harbor_network_mode": env.network()}
        | ({"harbor_metadata": cfg.metadata} if cfg.metadata else {}),
    }
    return task


def harbor_tasks(base: Path, spec: DatasetSpec, defaults: dict[str, Any]) -> list[dict[str, Any]]:
    """One task per Harbor task directory under `base / spec.path`, `defaults` merged over each."""
    root = base / spec.path
    tasks = []
    for d in task_dirs(root, spec):
        rel = Path(spec.path) if d == root else Path(spec.path) / d.name
        tasks.append(merge_defaults(harbor_task(d, rel.as_posix()), defaults))
    return tasks
