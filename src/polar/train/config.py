"""`polar train CONFIG`: the YAML a training run is described by, validated once with errors at the line.

    model: null                 # HF id or folder; null = the engine's offline tiny model
    tasks: tasks.yaml           # a task file (relative to this file) or a list of tasks inline
    group_size: 4               # samples per task group (overrides the tasks' num_samples)
    batch_groups: 2             # groups per optimizer step
    steps: 10
    max_staleness: 2            # drop groups sampled more than this many policy versions ago
    estimator: rloo             # grpo | rloo | dr_grpo
    loss: {eps_low: 0.2, eps_high: 0.28, tis_cap: 2.0, kl_coef: 0.0, aggregation: token_mean}
    optimizer: {lr: 1.0e-6, weight_decay: 0.1, betas: [0.9, 0.999], grad_clip: 1.0, schedule: cosine}
    filter: {zero_variance: true}           # optional: leave out groups without a gradient, take the next
    overlong: {mode: mask}                  # optional: leave out sessions with an answer cut by max_tokens
    eval: {tasks: held-out.yaml, every: 10} # optional: held-out accuracy with a 95 % interval
    backend: embedded           # or the URL of a vLLM server, or a list of URLs (weights synced over RL routes)
    out: polar-train
    resume: polar-train/checkpoints/step-4   # optional: continue a run (`steps` counts from the start)

A bad field is reported as `train.yaml:7: optimizer.lr: Input should be greater than 0`. Any field can be
changed from the command line with a dotted path (`polar train CONFIG --set loss.eps_high=0.3`, see
`parse_override`); a bad override names itself: `--set loss.eps_high=abc: Input should be a valid number`.
Every field's type, default and meaning: docs/reference/train-config.md (generated from these models).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from polar import hints, yamlpos
from polar.jsontypes import JSON
from polar.netguard import OutboundPolicy
from polar.rollout.taskfile import (
    TaskFileError,
    UploadOutside,
    anchor_uploads,
    check_local,
    check_outbound_urls,
    load_tasks,
    locator,
)
from polar.task import Task
from polar.train import overrides as overrides_mod
from polar.train.advantages import Estimator
from polar.train.filters import GroupFilter, Overlong
from polar.train.lora import LoraSpec
from polar.train.loss import Aggregation, LossConfig
from polar.train.names import polar_name_for
from polar.train.overrides import ConfigError, Override, OverrideError, apply_overrides, culprit

__all__ = [  # the config's API, overrides included (cli/train.py, tests)
    "ConfigError",
    "Override",
    "OverrideError",
    "TrainConfig",
    "apply_overrides",
    "field_paths",
    "load_config",
    "parse_config",
    "parse_override",
    "suggest",
    "upload_roots",
]
from polar.yamlpos import Document, YAMLSyntaxError, field_path


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LossSection(_Section):
    """The policy loss (`polar.train.loss`): token-level PPO-clip with asymmetric bounds, a truncated
    importance weight, an optional k3 KL. `polar train` takes one optimizer step per batch and measures the
    PPO ratio against the policy just before it, so the ratio is 1 at that step and the clip never binds
    (`clip_fraction` stays 0); the TIS weight is what corrects for the sampler's mismatch and staleness."""

    eps_low: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="Lower PPO clip: the clipped ratio range is [1 - eps_low, 1 + eps_high].",
    )
    eps_high: float = Field(
        0.28, ge=0.0, description="Upper PPO clip; larger than eps_low is DAPO's clip-higher."
    )
    tis_cap: float | None = Field(
        2.0,
        gt=0.0,
        description="Cap of the per-token truncated importance weight pi_trainer / pi_behaviour, which "
        "corrects for sampler/trainer mismatch and stale samples; null: no weight (1).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of a k3 KL penalty to the initial policy; > 0 keeps a frozen copy of the "
        "initial model in memory as the reference.",
    )
    aggregation: Aggregation = Field(
        "token_mean",
        description="token_mean: every trainable token of the batch counts once; sequence_mean: each "
        "trace's mean, weighted so that each trajectory counts once.",
    )

    def to_loss_config(self) -> LossConfig:
        return LossConfig(**self.model_dump())


class OptimizerSection(_Section):
    """AdamW. Defaults are the paper's (lr 1e-6, weight decay 0.1)."""

    lr: float = Field(1e-6, gt=0.0, description="Base learning rate (the schedule scales it per step).")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="After warm-up: constant, or a linear or cosine decay to `min_lr_ratio` x `lr` at the "
        "run's last step (`steps`).",
    )
    warmup_steps: int = Field(
        0, ge=0, description="Steps of linear warm-up from lr/warmup_steps to `lr`; 0: none."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="The decayed rate at the last step, as a fraction of `lr`."
    )
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW's decoupled weight decay.")
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="AdamW's (beta1, beta2); each must be in [0, 1)."
    )
    eps: float = Field(1e-8, gt=0.0, description="AdamW's epsilon.")
    grad_clip: float | None = Field(
        1.0,
        gt=0.0,
        description="Clip the global gradient L2 norm to this before the step; null: no clipping "
        "(`grad_norm` is measured either way).",
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class LoraSection(_Section):
    """LoRA adapters (peft) instead of full fine-tuning: only the adapters train; every weight sync sends the
    base model with the adapters merged in (polar.train.lora)."""

    r: int = Field(16, ge=1, le=4096, description="Rank of each adapter.")
    alpha: float = Field(32.0, gt=0.0, description="Scale numerator: an adapter adds (alpha / r) * B @ A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input.")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Which layers get adapters: all-linear (every linear layer but the output head) or "
        "a list of module names (q_proj, v_proj, ...).",
    )

    sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="How a vLLM server gets each version: merged (the base with the adapters folded in, "
        "reloaded like a full model: any server) or adapter (only the adapter, loaded at runtime under "
        "`adapter_name`: the server runs with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=true). "
        "The embedded engine always takes merged weights.",
    )
    adapter_name: str = Field(
        "polar-policy",
        min_length=1,
        description="The name the adapter is served under (sync: adapter); rollouts ask for this model.",
    )

    def spec(self) -> LoraSpec:
        targets = self.target_modules
        return LoraSpec(
            self.r, self.alpha, self.dropout, targets if isinstance(targets, str) else tuple(targets)
        )


class MetricsSection(_Section):
    """Where per-step metrics go besides the console and `out/metrics.jsonl` (always written)."""

    tensorboard: bool = Field(
        False,
        description="Also write TensorBoard scalars to out/tensorboard (needs the `tensorboard` extra: "
        "`pip install 'polar-rl[tensorboard]'`; without it polar train stops before starting, exit 2).",
    )
    wandb: bool = Field(
        False,
        description="Also log to Weights & Biases (needs the `wandb` extra: `pip install 'polar-rl[wandb]'`; "
        "without it polar train stops before starting, exit 2).",
    )
    wandb_project: str = Field("polar", description="W&B project.")
    run_name: str | None = Field(None, description="W&B run name; null lets W&B choose one.")


class FilterSection(_Section):
    """Dynamic sampling (polar.train.filters): leave out finished groups that carry no gradient and take the
    next ones, so each step trains on `batch_groups` informative groups. Left-out groups are counted
    (`filtered_*` metrics)."""

    zero_variance: bool = Field(
        False,
        description="Leave out a group whose advantages are all 0 (every sample earned the same reward).",
    )
    all_masked: bool = Field(
        False,
        description="Leave out a group whose every session was masked (failed for reasons that are not "
        "the policy's: infrastructure errors, deadline timeouts).",
    )
    max_groups_per_step: int | None = Field(
        None,
        ge=1,
        description="Groups one step may take in all, kept and left out (the oversampling cap); past it the "
        "step fills up with the groups it left out (`filter_cap_reached` 1). null: 4 x batch_groups. "
        "Must be at least batch_groups.",
    )


class OverlongSection(_Section):
    """Answers cut by the token limit (polar.train.filters): kept as they are, masked, or a soft length
    penalty on every answer (DAPO's overlong reward shaping)."""

    mode: Literal["keep", "mask", "penalty"] = Field(
        "keep",
        description="keep: train on them as they are; mask: leave out every session with an answer cut by "
        "the token limit (finish_reason length); penalty: add a length penalty to each session's reward: 0 "
        "up to max_tokens - buffer tokens in its longest answer, then falling linearly to -penalty_factor "
        "at max_tokens.",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="penalty: the answer length (tokens, one sampled turn) the penalty reaches "
        "-penalty_factor at; the max_tokens the harness asks for. Required for mode penalty.",
    )
    buffer: int = Field(
        0,
        ge=0,
        description="penalty: tokens before max_tokens over which the penalty ramps from 0 down; 0: a "
        "penalty only at max_tokens.",
    )
    penalty_factor: float = Field(1.0, gt=0.0, description="penalty: the largest penalty.")

    @model_validator(mode="after")
    def _penalty_needs_a_length(self) -> OverlongSection:
        if self.mode == "penalty" and self.max_tokens is None:
            raise ValueError("mode penalty needs max_tokens (the answer length the penalty is full at)")
        if self.max_tokens is not None and self.buffer > self.max_tokens:
            raise ValueError(f"buffer ({self.buffer}) is longer than max_tokens ({self.max_tokens})")
        return self

    def spec(self) -> Overlong:
        return Overlong(self.mode, self.max_tokens, self.buffer, self.penalty_factor)


def _task_source(v: JSON) -> JSON:
    """A task file (a path) or a non-empty list of inline tasks: `tasks` and `eval.tasks`."""
    if isinstance(v, str) and v:
        return v
    if isinstance(v, list) and v and all(isinstance(t, dict) for t in v):
        return v
    raise ValueError("must be a task file (path relative to this file) or a non-empty list of tasks")


class EvalSection(_Section):
    """Held-out evaluation during training (polar.train.evaluation): tasks the policy never trains on, run
    through the same stack right after a weight sync, scored as accuracy with a 95 % interval."""

    tasks: str | list[dict[str, Any]] = Field(
        description="A task file (relative to this config file) or a list of tasks inline, as `tasks`; their "
        "task_ids may repeat the training tasks' (each evaluation gets ids of its own).",
    )
    every: int = Field(10, ge=1, description="Evaluate after every N-th step, and after the last.")
    samples: int | None = Field(
        None, ge=1, le=4096, description="Samples per held-out task; null: each task's num_samples."
    )
    before_training: bool = Field(
        True, description="Also evaluate the starting policy (step 0) before the first step of a new run."
    )
    _loaded: list[Task] = PrivateAttr(default_factory=list)

    _source = field_validator("tasks", mode="before")(_task_source)

    @property
    def loaded_tasks(self) -> list[Task]:
        """The held-out tasks, loaded and checked by `parse_config`."""
        return self._loaded


def outbound(allow: list[str]) -> OutboundPolicy:
    """The run's outbound policy for task-given URLs (`allow_callback`); a bad entry is a ValueError."""
    return OutboundPolicy(allow=tuple(allow))


class TrainConfig(_Section):
    """A `polar train` run: the policy, its tasks, the GRPO batch, the loss and optimizer, where it runs."""

    model: str | None = Field(
        None,
        description="The policy to train: a Hugging Face model id or a local folder; null: the embedded "
        "engine's offline tiny model (real Qwen3 tokenizer, random weights: for plumbing).",
    )
    tasks: str | list[dict[str, Any]] = Field(
        description="A task file (YAML or JSON, relative to this config file; relative to the current "
        "directory when given with --set) or a non-empty list of tasks inline (see task.md).",
    )
    group_size: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Samples per task group (one GRPO group); overrides each task's `num_samples`. "
        "null: each task's `num_samples`.",
    )
    batch_groups: int = Field(2, ge=1, description="Task groups per optimizer step.")
    steps: int = Field(
        1,
        ge=1,
        description="Optimizer steps in all (a resumed run counts from step 0, not from its checkpoint).",
    )
    max_staleness: int = Field(
        2,
        ge=0,
        description="Drop a group whose oldest token was sampled more than this many policy versions "
        "before the step that would train on it (0: on-policy only). Dropped groups are counted.",
    )
    pace: bool = Field(
        True,
        description="Submit a group only while it would be trained within max_staleness versions of the "
        "policy that samples it (groups submitted, less those dropped or left out, <= (steps + max_staleness "
        "+ 1) x batch_groups): rollouts wait for a sync instead of running ahead to be dropped. false: keep "
        "max_in_flight groups running and drop those that come back too old.",
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="Task groups submitted to the rollout server and not yet trained on; null: 2 x "
        "batch_groups. More keeps the policy server busy while the trainer steps, at more staleness.",
    )
    estimator: Estimator = Field(
        "rloo",
        description="Group-relative advantage: grpo (r - mean) / std; rloo r - mean of the others; "
        "dr_grpo r - mean (no std).",
    )
    filter: FilterSection = Field(default_factory=FilterSection, description="See the filter section.")
    overlong: OverlongSection = Field(
        default_factory=OverlongSection, description="See the overlong section."
    )
    eval: EvalSection | None = Field(None, description="See the eval section; null: no held-out evaluation.")
    pass_threshold: float = Field(
        1.0,
        description="For `pass_rate` only: a session passed when its evaluation says so, else when its "
        "reward is at least this.",
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="The temperature the harness samples at; the trainer divides logits by it so its "
        "logprobs compare with the behaviour logprobs.",
    )
    loss: LossSection = Field(default_factory=LossSection, description="See the loss section.")
    optimizer: OptimizerSection = Field(
        default_factory=OptimizerSection, description="See the optimizer section."
    )
    lora: LoraSection | None = Field(
        None, description="See the lora section; null: full fine-tuning (every weight trains)."
    )
    micro_batch_tokens: int = Field(
        4096,
        ge=1,
        description="Tokens per forward pass: traces are packed into micro-batches of about this many "
        "tokens (a longer trace gets one of its own).",
    )
    grad_accum: int = Field(
        1,
        ge=1,
        description="Split each step into at least this many micro-batches (when there are enough traces); "
        "gradients accumulate over them.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, more compute."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Autocast dtype of forward and backward; weights and optimizer state stay float32. "
        "auto: bfloat16 on a CUDA device that has it, else float32.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the trainer (and the embedded engine) runs; auto: CUDA when available."
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="Under torchrun with several processes: ddp (every rank holds the whole model and "
        "optimizer state) or fsdp (FSDP2: parameters, gradients and optimizer state sharded over the ranks, "
        "per decoder layer; for a policy that does not fit one device). Ignored in one process.",
    )
    dist_timeout_s: float = Field(
        86400.0,
        gt=0,
        description="Under torchrun: how long a collective may wait. The ranks but the first wait in one "
        "while the first waits for a batch of rollouts, so this must exceed the slowest batch (torch's own "
        "defaults, 10 min with NCCL and 30 with gloo, are too short for agentic rollouts).",
    )
    seed: int = Field(
        0, description="torch's random seed, set before the model is loaded, and the seed of the task order."
    )
    shuffle: bool = Field(
        True,
        description="Draw the tasks in a new seeded order on each pass over the task file (false: the file's "
        "order). Sorted task files otherwise give batches that are alike.",
    )
    out: str = Field(
        "polar-train",
        description="Output directory (relative to the current directory): metrics.jsonl, checkpoints/, "
        "gateway.db, server.db.",
    )
    checkpoint_every: int | None = Field(
        None, ge=1, description="Save a checkpoint every N steps; the last step is always saved."
    )
    resume: str | None = Field(
        None,
        description="A checkpoints/step-N folder written by polar train: continue from its weights, "
        "optimizer state and step count (metrics are appended).",
    )
    backend: str | list[str] = Field(
        "embedded",
        description="The policy server: embedded (polar's engine, in this process), or the base URL of a "
        "vLLM server, or a list of URLs of vLLM servers serving the same model (the gateway spreads "
        "sessions over them); their weights are reloaded over their RL routes after each step.",
    )
    served_model: str | None = Field(
        None, description="The model name the vLLM server serves; null: the first one it lists."
    )
    render: Literal["server", "gateway"] = Field(
        "server",
        description="Who renders the rollouts' prompts: the server (its chat route), or the gateway, which "
        "continues each session's exact token chain and sends token ids (one trace per session where the "
        "server's rendering drifts from what was sampled; docs/backends.md).",
    )
    capacity: int = Field(4, ge=1, description="Sessions the local gateway node runs at once.")
    allow_callback: list[str] = Field(
        default_factory=list,
        description="Where task-given URLs (callbacks, side-call and judge backends) may point although "
        "they are not public addresses: IPs, CIDRs or host names (e.g. 127.0.0.1 for a judge served on "
        "this machine); link-local and cloud metadata addresses stay refused (`polar run --allow-callback`).",
    )
    drain_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Seconds a weight sync waits, with the gateway paused, for calls in flight to finish; "
        "past it the sync proceeds (`sync_drained` 0).",
    )
    verify_weight_sync: bool = Field(
        True,
        description="After each reload, check that every vLLM server scores a fixed text as the trainer "
        "does (mean logprob difference <= 0.1); a server that does not is paused and the sync fails.",
    )
    metrics: MetricsSection = Field(default_factory=MetricsSection, description="See the metrics section.")

    @field_validator("allow_callback")
    @classmethod
    def _allow_callback(cls, v: list[str]) -> list[str]:
        outbound(v)  # a bad entry is this field's error
        return v

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str | list[str]) -> str | list[str]:
        if v == "embedded":
            return v
        urls = [v] if isinstance(v, str) else v
        if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
            raise ValueError("must be 'embedded', or an http(s) URL of a vLLM server, or a list of them")
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError("names a server twice")
        return urls[0] if isinstance(v, str) else urls

    _tasks = field_validator("tasks", mode="before")(_task_source)

    @model_validator(mode="after")
    def _cap_fits_a_batch(self) -> TrainConfig:
        cap = self.filter.max_groups_per_step
        if cap is not None and cap < self.batch_groups:
            # Raised at the field, not the config: the error then points at its line.
            error = PydanticCustomError(
                "value_error", "is less than batch_groups ({b})", {"b": self.batch_groups}
            )
            loc = ("filter", "max_groups_per_step")
            detail = InitErrorDetails(type=error, loc=loc, input=cap)
            raise ValidationError.from_exception_data(type(self).__name__, [detail])
        return self

    @property
    def in_flight(self) -> int:
        return self.max_in_flight or 2 * self.batch_groups

    def group_filter(self) -> GroupFilter:
        f = self.filter
        return GroupFilter(f.zero_variance, f.all_masked, f.max_groups_per_step or 4 * self.batch_groups)

    def loss_config(self) -> LossConfig:
        return self.loss.to_loss_config()


# -- field paths and overrides, bound to TrainConfig (polar.train.overrides) -------------------------------


def field_paths(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted field path of `model` (default `TrainConfig`): sections and their fields, in order."""
    return overrides_mod.field_paths(model or TrainConfig, prefix)


def suggest(path: Sequence[Any], model: type[BaseModel] | None = None) -> str | None:
    """The field path of `model` (default `TrainConfig`, which also knows TRL's and verl's names) an unknown
    `path` most likely meant (`polar.train.overrides.suggest`)."""
    root = model or TrainConfig
    return overrides_mod.suggest(path, root, polar_name_for if root is TrainConfig else None)


def parse_override(text: str) -> Override:
    """`--set KEY=VALUE` for a `TrainConfig` field (`polar.train.overrides.parse_override`)."""
    return overrides_mod.parse_override(text, TrainConfig, polar_name_for)


def _message(err: ErrorDetails) -> str:
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def _error(
    exc: ValidationError,
    doc: Document,
    overrides: Sequence[Override],
    prefix: tuple[Any, ...] = (),
    model: type[BaseModel] | None = None,
) -> ConfigError:
    """The first validation error as `file:line: field: reason`, or as `OVERRIDE: reason` when an override
    set the bad value; an unknown key gets the closest field name."""
    errors = exc.errors(include_url=False)
    # A misspelt key also leaves the real one missing: the unknown key is the error worth naming.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = (*prefix, *err["loc"])
    msg = _message(err)
    if err["type"] == "extra_forbidden":
        hint = suggest(err["loc"], model)
        if hint:
            msg += f" (did you mean {field_path((*prefix, *hint.split('.')))}?)"
    else:  # a near miss of a choice (`estimator: rlo`, `runtime: {backend: dokcer}`)
        msg = hints.hint(err, model or TrainConfig)
    by = culprit(loc, overrides)
    if by is not None:
        raw = by.label.partition("=")[2]
        if err["type"] == "string_type" and raw and not isinstance(err["input"], (str, dict, list)):
            msg += f" (YAML reads {raw} as {type(err['input']).__name__}; quote it: --set '{field_path(loc)}=\"{raw}\"')"
        where = by.label if loc == by.path else f"{by.label}: {field_path(loc)}"
        return OverrideError(f"{where}: {msg}")
    return ConfigError(f"{doc.at(loc, 'config')}: {msg}")


def parse_config(
    text: str, source: str = "<config>", base: Path | None = None, overrides: Sequence[Override] = ()
) -> tuple[TrainConfig, list[Task]]:
    """The config with `overrides` applied, and its tasks (validated, uploads anchored at `base`, or at the
    current directory when an override set `tasks`); raises `ConfigError`, or `OverrideError` when the bad
    value came from an override."""
    try:
        doc = yamlpos.parse(text, source)
    except YAMLSyntaxError as exc:
        raise ConfigError(f"{exc.where}: not valid YAML: {exc.problem}") from None
    data = doc.data
    if data is None and overrides:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of settings (model, tasks, steps, ...)")
    data = apply_overrides(data, overrides)
    try:
        config = TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise _error(exc, doc, overrides) from None
    policy = outbound(config.allow_callback)
    tasks = _load_tasks(config.tasks, ("tasks",), config.group_size, doc, overrides, base, policy)
    if config.eval is not None:
        held_out = _load_tasks(
            config.eval.tasks, ("eval", "tasks"), config.eval.samples, doc, overrides, base, policy
        )
        config.eval._loaded = held_out
    return config, tasks


def _load_tasks(
    source: str | list[dict[str, Any]],
    key: tuple[str, ...],
    num_samples: int | None,
    doc: Document,
    overrides: Sequence[Override],
    base: Path | None,
    policy: OutboundPolicy,
) -> list[Task]:
    """The tasks a config names at `key`: a task file relative to `base` (to the current directory when an
    override set it), or inline ones (uploads relative to `base`); each error at its line, the URLs the
    run's server would refuse (`policy`: `allow_callback`) included."""
    by = culprit(key, overrides)
    base = Path.cwd() if by is not None else (base or Path.cwd())
    fail = OverrideError if by is not None else ConfigError
    where = by.label if by is not None else doc.at(key)
    if isinstance(source, str):
        try:
            return load_tasks(base / source, num_samples=num_samples, outbound=policy)
        except TaskFileError as exc:
            raise fail(f"{where}: {exc}") from None
    tasks = []
    located = []
    for i, item in enumerate(source):
        try:
            task = Task.model_validate(item)
        except ValidationError as exc:
            raise _error(exc, doc, overrides, (*key, i), Task) from None
        if num_samples is not None:  # what the trainer submits
            task = task.model_copy(update={"num_samples": num_samples})
        locate = locator(doc, (*key, i))
        try:  # inline tasks' uploads are relative to the config file and stay in its directory
            task = anchor_uploads(task, base)
        except UploadOutside as exc:
            raise fail(f"{locate(('runtime', 'prepare', exc.index, 'src'))}: {exc.reason}") from None
        try:  # the user's own code, relative to this file; then what the server would check
            check_local(task, base, locate)
        except TaskFileError as exc:
            raise fail(str(exc)) from None
        tasks.append(task)
        located.append((task, locate))
    try:
        check_outbound_urls(located, policy)
    except TaskFileError as exc:
        raise fail(str(exc)) from None
    ids = [t.task_id for t in tasks]
    dupes = sorted({t for t in ids if ids.count(t) > 1})
    if dupes:
        raise fail(f"{where}: duplicate task_id {', '.join(dupes)}")
    return tasks


def load_config(path: str | Path, overrides: Sequence[Override] = ()) -> tuple[TrainConfig, list[Task]]:
    """Read and validate a training config file, with command-line `overrides` applied; a task file it
    names is relative to it."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    return parse_config(text, str(p), p.resolve().parent, overrides)


def upload_roots(config: TrainConfig, path: str | Path) -> tuple[Path, ...]:
    """Where the tasks of the config at `path` may upload from: their task file's directory, or the
    config's own for inline tasks (what the local node is allowed to read)."""
    base = Path(path).resolve().parent
    sources = [config.tasks] + ([config.eval.tasks] if config.eval is not None else [])
    roots = [(base / s).resolve().parent if isinstance(s, str) else base for s in sources]
    return tuple(dict.fromkeys(roots))
