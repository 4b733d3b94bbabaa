"""`polar train CONFIG`: the YAML a training run is described by, validated once with errors at the line.

    model: null                 # HF id or folder; null = the engine's offline tiny model
    tasks: tasks.yaml           # a task file (relative to this file) or a list of tasks inline
    group_size: 4               # samples per task group (overrides the tasks' num_samples)
    batch_groups: 2             # groups per optimizer step
    steps: 10
    max_staleness: 2            # drop groups sampled more than this many policy versions ago
    estimator: rloo             # grpo | rloo | dr_grpo
    loss: {eps_low: 0.2, eps_high: 0.28, tis_cap: 2.0, kl_coef: 0.0, aggregation: token_mean}
    optimizer: {lr: 1.0e-6, weight_decay: 0.1, betas: [0.9, 0.999], grad_clip: 1.0}
    backend: embedded           # or the URL of a vLLM server (weights synced over its RL routes)
    out: polar-train
    resume: polar-train/checkpoints/step-4   # optional: continue a run (`steps` counts from the start)

A bad field is reported as `train.yaml:7: optimizer.lr: Input should be greater than 0`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from polar.rollout.task import Task
from polar.rollout.taskfile import (
    TaskFileError,
    UploadOutside,
    anchor_uploads,
    field_path,
    line_of,
    load_tasks,
)
from polar.train.advantages import Estimator
from polar.train.loss import Aggregation, LossConfig


class ConfigError(ValueError):
    """A training config that cannot be used, with `path:line: field: reason` in its message."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LossSection(_Section):
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    eps_high: float = Field(0.28, ge=0.0)
    tis_cap: float | None = Field(2.0, gt=0.0)  # null: no truncated importance weight
    kl_coef: float = Field(0.0, ge=0.0)  # > 0 keeps a frozen copy of the initial policy as the reference
    aggregation: Aggregation = "token_mean"

    def to_loss_config(self) -> LossConfig:
        return LossConfig(**self.model_dump())


class OptimizerSection(_Section):
    """AdamW. Defaults are the paper's (lr 1e-6, weight decay 0.1)."""

    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.1, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    grad_clip: float | None = Field(1.0, gt=0.0)  # max global grad norm; null: no clipping

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class MetricsSection(_Section):
    """Where per-step metrics go besides the console and `out/metrics.jsonl` (always written)."""

    tensorboard: bool = False  # needs the `tensorboard` package
    wandb: bool = False  # needs `wandb`; project and run name below
    wandb_project: str = "polar"
    run_name: str | None = None


class TrainConfig(_Section):
    model: str | None = None
    tasks: str | list[dict[str, Any]]
    group_size: int | None = Field(None, ge=1, le=4096)
    batch_groups: int = Field(2, ge=1)
    steps: int = Field(1, ge=1)
    max_staleness: int = Field(2, ge=0)
    max_in_flight: int | None = Field(None, ge=1)  # task groups running at once (default 2 x batch_groups)
    estimator: Estimator = "rloo"
    pass_threshold: float = 1.0
    temperature: float = Field(1.0, gt=0.0)  # the harness's sampling temperature (logprobs are taken at it)
    loss: LossSection = Field(default_factory=LossSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    micro_batch_tokens: int = Field(4096, ge=1)  # tokens per forward pass (packed traces)
    grad_accum: int = Field(1, ge=1)  # at least this many micro-batches per step (gradients accumulate)
    gradient_checkpointing: bool = False
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 autocast on CUDA that has it
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    out: str = "polar-train"
    checkpoint_every: int | None = Field(None, ge=1)  # steps between checkpoints; the last step always
    resume: str | None = None  # a checkpoints/step-N folder: weights, optimizer state and step count
    backend: str = "embedded"  # "embedded" or the base URL of a vLLM server
    served_model: str | None = None  # the name the vLLM server serves (default: what it lists)
    capacity: int = Field(4, ge=1)  # sessions the node runs at once
    drain_timeout_s: float = Field(600.0, gt=0.0)  # how long a weight sync waits for calls in flight
    metrics: MetricsSection = Field(default_factory=MetricsSection)

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v != "embedded" and not v.startswith(("http://", "https://")):
            raise ValueError("must be 'embedded' or an http(s) URL of a vLLM server")
        return v.rstrip("/")

    @field_validator("tasks", mode="before")
    @classmethod
    def _tasks(cls, v: Any) -> Any:
        if isinstance(v, str) and v:
            return v
        if isinstance(v, list) and v and all(isinstance(t, dict) for t in v):
            return v
        raise ValueError("must be a task file (path relative to this file) or a non-empty list of tasks")

    @property
    def in_flight(self) -> int:
        return self.max_in_flight or 2 * self.batch_groups

    def loss_config(self) -> LossConfig:
        return self.loss.to_loss_config()


def _message(err: Any) -> str:
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def _where(source: str, root: yaml.Node | None, loc: tuple[Any, ...]) -> str:
    line = line_of(root, loc)
    return f"{source}:{line}" if line else source


def parse_config(
    text: str, source: str = "<config>", base: Path | None = None
) -> tuple[TrainConfig, list[Task]]:
    """The config and its tasks (validated, uploads anchored at `base`); raises `ConfigError`."""
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of settings (model, tasks, steps, ...)")
    try:
        config = TrainConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = tuple(err["loc"])
        raise ConfigError(
            f"{_where(source, root, loc)}: {field_path(loc) or 'config'}: {_message(err)}"
        ) from None
    base = base or Path.cwd()
    if isinstance(config.tasks, str):
        try:
            tasks = load_tasks(base / config.tasks)
        except TaskFileError as exc:
            raise ConfigError(f"{_where(source, root, ('tasks',))}: tasks: {exc}") from None
    else:
        tasks = []
        for i, item in enumerate(config.tasks):
            try:  # inline tasks' uploads are relative to the config file and stay in its directory
                tasks.append(anchor_uploads(Task.model_validate(item), base))
            except UploadOutside as exc:
                loc = ("tasks", i, "runtime", "prepare", exc.index, "src")
                raise ConfigError(f"{_where(source, root, loc)}: {field_path(loc)}: {exc.reason}") from None
            except ValidationError as exc:
                err = exc.errors(include_url=False)[0]
                loc = ("tasks", i, *err["loc"])
                raise ConfigError(
                    f"{_where(source, root, loc)}: {field_path(loc)}: {_message(err)}"
                ) from None
        ids = [t.task_id for t in tasks]
        dupes = sorted({t for t in ids if ids.count(t) > 1})
        if dupes:
            raise ConfigError(
                f"{_where(source, root, ('tasks',))}: tasks: duplicate task_id {', '.join(dupes)}"
            )
    return config, tasks


def load_config(path: str | Path) -> tuple[TrainConfig, list[Task]]:
    """Read and validate a training config file; a task file it names is relative to it."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    return parse_config(text, str(p), p.resolve().parent)


def upload_roots(config: TrainConfig, path: str | Path) -> tuple[Path, ...]:
    """Where the tasks of the config at `path` may upload from: their task file's directory, or the
    config's own for inline tasks (what the local node is allowed to read)."""
    base = Path(path).resolve().parent
    return ((base / config.tasks).resolve().parent,) if isinstance(config.tasks, str) else (base,)
