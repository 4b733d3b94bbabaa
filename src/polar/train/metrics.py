"""Per-step training metrics: one record per optimizer step, to the console, a JSONL file and optional sinks.

`out/metrics.jsonl` is always written (one JSON object per line, flushed every step, so a crashed run keeps
what it measured). TensorBoard and W&B are used only when enabled in the config *and* installed; asking for
one that is missing is an error at start-up, not a silent no-op.

`METRICS` declares every key a record can hold, with its unit and meaning: the writer orders each line by it,
`polar.docs` renders it as the `metrics.jsonl` reference, and a test fails on a key written but not declared.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from polar.extras import TENSORBOARD, WANDB, require


@dataclass(frozen=True, slots=True)
class Metric:
    """What one metrics key measures: its `unit` and `meaning`, as the reference documents them."""

    unit: str
    meaning: str


# Every key of a metrics line, in the order it is written. A key written without an entry here is an error
# caught by the tests (`undeclared`), so a new metric cannot ship undocumented.
METRICS: dict[str, Metric] = {
    "step": Metric("count", "1-based optimizer step this line describes"),
    "policy_version": Metric(
        "version", "policy version the step produced and synced to the policy server (equals `step`)"
    ),
    "reward_mean": Metric(
        "reward", "mean reward over the batch's unmasked trajectories (the evaluator's scale, e.g. 0..1)"
    ),
    "reward_std": Metric(
        "reward",
        "population standard deviation (n in the denominator) of the rewards `reward_mean` averages; "
        "0 when every trajectory got the same reward",
    ),
    "pass_rate": Metric(
        "fraction 0..1",
        "share of unmasked trajectories that passed: the evaluation's `passed`, else reward >= `pass_threshold`",
    ),
    "groups": Metric("count", "task groups in the batch (`batch_groups`)"),
    "samples": Metric("count", "unmasked trajectories in the batch (masked ones are counted in `masked`)"),
    "zero_variance_groups": Metric(
        "count", "groups whose rewards were all equal: every advantage 0, no learning signal"
    ),
    "dropped_stale_groups": Metric(
        "count", "groups dropped since the previous step for being more than `max_staleness` versions old"
    ),
    "staleness_mean": Metric(
        "policy versions",
        "mean over the batch's groups of (trainer version - oldest version that sampled a token of the group)",
    ),
    "staleness_max": Metric("policy versions", "largest staleness of a group in the batch"),
    "traces": Metric("count", "traces trained on (trainable tokens, behaviour logprobs and a prompt)"),
    "tokens": Metric("tokens", "prompt + response tokens through the model this step (padding excluded)"),
    "trainable_tokens": Metric("tokens", "tokens with `loss_mask` 1 in the traces trained on"),
    "loss": Metric(
        "-",
        "the batch's loss at the step (TIS-weighted PPO-clip term plus `kl_coef` x KL), before the update",
    ),
    "grad_norm": Metric("L2 norm", "global gradient norm before clipping to `optimizer.grad_clip`"),
    "clip_fraction": Metric(
        "fraction 0..1",
        "trainable tokens whose PPO ratio was clipped; 0 in `polar train`, which takes one optimizer step "
        "per batch, so the ratio against the policy before the step is 1",
    ),
    "kl": Metric(
        "nats (k3 estimate)", "mean k3 KL to the frozen initial policy; 0 unless `loss.kl_coef` > 0"
    ),
    "tis_mean": Metric(
        "ratio",
        "mean truncated importance weight min(pi_trainer / pi_behaviour, `tis_cap`) over trainable tokens; "
        "1 when `tis_cap` is null",
    ),
    "logprob_diff": Metric(
        "nats",
        "mean |trainer logprob - behaviour logprob| over trainable tokens before the step: sampler/trainer "
        "mismatch plus staleness",
    ),
    "rollout_wait_s": Metric("seconds", "time waiting for a batch of finished, fresh groups"),
    "train_s": Metric("seconds", "forward, backward and optimizer step"),
    "sync_s": Metric("seconds", "gateway pause and drain, weight push to the policy server, resume"),
    "masked": Metric(
        "count", "masked trajectories in the batch (infrastructure errors, deadline timeouts): not trained"
    ),
    "untrainable_traces": Metric(
        "count", "traces with trainable tokens skipped because they lack behaviour logprobs or a prompt"
    ),
    "lr": Metric(
        "learning rate", "the rate the step took: `optimizer.lr` x the schedule's factor at this step"
    ),
    "tool_call_parse_errors": Metric(
        "count",
        "traces in the batch holding a call the server could not parse (markup left in the content, a tool "
        "not offered, arguments the schema refuses): reward 0, trained on as negatives",
    ),
    "filtered_zero_variance_groups": Metric(
        "count",
        "groups taken since the previous step and left out because every advantage was 0 "
        "(`filter.zero_variance`); the step took the next finished group instead",
    ),
    "filtered_masked_groups": Metric(
        "count",
        "groups taken since the previous step and left out because every session was masked "
        "(`filter.all_masked`)",
    ),
    "filter_cap_reached": Metric(
        "0 or 1",
        "1 when the step took `filter.max_groups_per_step` groups and still lacked informative ones: it "
        "filled up with the groups it had left out (which are then not counted as filtered)",
    ),
    "overlong_samples": Metric(
        "count",
        "trajectories in the batch masked for an answer cut by the token limit (`overlong.mode: mask`) or "
        "given a length penalty (`overlong.mode: penalty`)",
    ),
    "eval_accuracy": Metric(
        "fraction 0..1",
        "at evaluation steps only (`eval.every`): share of the held-out tasks' scored samples that passed, "
        "sampled by this step's policy; the step-0 baseline and per-task detail are in eval.jsonl",
    ),
    "eval_accuracy_low": Metric(
        "fraction 0..1", "lower end of `eval_accuracy`'s 95 % bootstrap interval (tasks resampled)"
    ),
    "eval_accuracy_high": Metric("fraction 0..1", "upper end of the same interval"),
    "eval_reward_mean": Metric("reward", "mean reward of the held-out samples that were scored"),
    "eval_samples": Metric("count", "held-out samples scored"),
    "eval_errors": Metric("count", "held-out sessions without a reward (masked): left out of the accuracy"),
    "eval_s": Metric("seconds", "wall time of the evaluation (submission to the last session)"),
    "sync_drained": Metric(
        "0 or 1", "1 when every in-flight call finished before `drain_timeout_s`; 0 when the drain timed out"
    ),
}


def undeclared(keys: Iterable[str]) -> list[str]:
    """The keys not in `METRICS`, in the order given: what a test reports when a metric lacks its doc."""
    return [k for k in keys if k not in METRICS]


@dataclass(frozen=True, slots=True)
class StepMetrics:
    step: int  # 1-based optimizer step
    policy_version: int  # the version the step produced (synced to the policy server)
    reward_mean: float
    reward_std: float  # population std of the same rewards
    pass_rate: float
    groups: int
    samples: int  # trajectories in the batch (unmasked)
    zero_variance_groups: int
    dropped_stale_groups: int  # since the previous step
    staleness_mean: float  # policy versions between sampling and this step, over the batch's groups
    staleness_max: int
    traces: int  # traces trained on
    tokens: int  # prompt + response tokens through the model
    trainable_tokens: int
    loss: float
    grad_norm: float
    clip_fraction: float
    kl: float  # k3 to the reference policy (0 without one)
    tis_mean: float
    logprob_diff: float  # mean |trainer logprob - behaviour logprob| over trainable tokens (mismatch)
    rollout_wait_s: float  # waiting for a batch of groups
    train_s: float
    sync_s: float
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """One metrics line: declared keys in `METRICS` order, then any undeclared ones (kept, never lost)."""
        d = asdict(self)
        d.update(d.pop("extra"))
        ordered = {k: d.pop(k) for k in METRICS if k in d}
        return {**ordered, **d}


class Sink(Protocol):
    def log(self, m: StepMetrics) -> None: ...

    def close(self) -> None: ...


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: write them as null so every line parses."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


class JsonlSink:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "ab")  # noqa: SIM115 - open for the whole run, closed by close()

    def log(self, m: StepMetrics) -> None:
        self._f.write(orjson.dumps(_finite(m.to_dict())) + b"\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    def __init__(self, logdir: Path) -> None:
        require(TENSORBOARD)  # torch's writer needs the `tensorboard` package
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(logdir))

    def log(self, m: StepMetrics) -> None:
        for k, v in m.to_dict().items():
            if k != "step" and isinstance(v, int | float):
                self._w.add_scalar(f"train/{k}", v, m.step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    def __init__(self, project: str, name: str | None, config: dict[str, Any]) -> None:
        require(WANDB)
        import wandb

        self._run = wandb.init(project=project, name=name, config=config)

    def log(self, m: StepMetrics) -> None:
        self._run.log({f"train/{k}": v for k, v in m.to_dict().items() if k != "step"}, step=m.step)

    def close(self) -> None:
        self._run.finish()


class ConsoleSink:
    """A progress bar over the steps and one line per step."""

    def __init__(self, console: Console, steps: int) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self.task = self.progress.add_task("training steps", total=steps)
        self.progress.start()

    def log(self, m: StepMetrics) -> None:
        self.console.print(
            f"step {m.step:>4}  v{m.policy_version}  reward {m.reward_mean:.3f} ± {m.reward_std:.3f}  pass {m.pass_rate:.2f}  "
            f"loss {m.loss:+.4f}  clip {m.clip_fraction:.3f}  kl {m.kl:.4f}  tokens {m.tokens}  "
            f"stale {m.staleness_mean:.1f} (dropped {m.dropped_stale_groups})  "
            f"wait {m.rollout_wait_s:.1f}s train {m.train_s:.1f}s sync {m.sync_s:.1f}s"
        )
        self.progress.update(self.task, advance=1)

    def resumed_at(self, step: int) -> None:
        self.progress.update(self.task, completed=step)

    def close(self) -> None:
        self.progress.stop()


class Metrics:
    """Fans each step's record out to every sink; `history` keeps them for callers and tests."""

    def __init__(
        self, sinks: list[Sink], eval_path: Path | None = None, console: Console | None = None
    ) -> None:
        self.sinks = sinks
        self.history: list[StepMetrics] = []
        self.eval_path = eval_path  # one line per held-out evaluation (polar.train.evaluation)
        self.console = console

    @classmethod
    def create(
        cls,
        out: Path,
        *,
        steps: int,
        console: Console | None = None,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "polar",
        run_name: str | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> Metrics:
        sinks: list[Sink] = [JsonlSink(out / "metrics.jsonl")]
        if tensorboard:
            sinks.append(TensorBoardSink(out / "tensorboard"))
        if wandb:
            sinks.append(WandbSink(wandb_project, run_name, run_config or {}))
        if console is not None:
            sinks.append(ConsoleSink(console, steps))
        return cls(sinks, out / "eval.jsonl", console)

    def resumed_at(self, step: int) -> None:
        """A run resumed from a checkpoint of `step`: the console's bar counts from there (was: "2/12" at
        the end of a run resumed at step 10 of 12)."""
        for sink in self.sinks:
            if isinstance(sink, ConsoleSink):
                sink.resumed_at(step)

    def evaluated(self, line: dict[str, Any]) -> None:
        """A held-out evaluation (`EvalResult.line()`): appended to eval.jsonl, and a line on the console."""
        if self.eval_path is not None:
            with self.eval_path.open("ab") as f:
                f.write(orjson.dumps(_finite(line)) + b"\n")
        if self.console is not None:
            self.console.print(
                f"eval after step {line['step']}: accuracy {line['eval_accuracy']:.3f} "
                f"[{line['eval_accuracy_low']:.3f}, {line['eval_accuracy_high']:.3f}] over "
                f"{int(line['eval_samples'])} samples ({int(line['eval_errors'])} unscored), {line['eval_s']:.1f}s",
                highlight=False,
            )

    def log(self, m: StepMetrics) -> None:
        self.history.append(m)
        for sink in self.sinks:
            sink.log(m)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
