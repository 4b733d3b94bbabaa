"""Per-step training metrics: one record per optimizer step, to the console, a JSONL file and optional sinks.

`out/metrics.jsonl` is always written (one JSON object per line, flushed every step, so a crashed run keeps
what it measured). TensorBoard and W&B are used only when enabled in the config *and* installed; asking for
one that is missing is an error at start-up, not a silent no-op.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@dataclass(frozen=True, slots=True)
class StepMetrics:
    step: int  # 1-based optimizer step
    policy_version: int  # the version the step produced (synced to the policy server)
    reward_mean: float
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
        d = asdict(self)
        extra = d.pop("extra")
        return {**d, **extra}


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
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's writer needs the `tensorboard` package
            raise RuntimeError("metrics.tensorboard is on but `tensorboard` is not installed") from exc
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
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("metrics.wandb is on but `wandb` is not installed") from exc
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
            f"step {m.step:>4}  v{m.policy_version}  reward {m.reward_mean:.3f}  pass {m.pass_rate:.2f}  "
            f"loss {m.loss:+.4f}  clip {m.clip_fraction:.3f}  kl {m.kl:.4f}  tokens {m.tokens}  "
            f"stale {m.staleness_mean:.1f} (dropped {m.dropped_stale_groups})  "
            f"wait {m.rollout_wait_s:.1f}s train {m.train_s:.1f}s sync {m.sync_s:.1f}s"
        )
        self.progress.update(self.task, advance=1)

    def close(self) -> None:
        self.progress.stop()


class Metrics:
    """Fans each step's record out to every sink; `history` keeps them for callers and tests."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks
        self.history: list[StepMetrics] = []

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
        return cls(sinks)

    def log(self, m: StepMetrics) -> None:
        self.history.append(m)
        for sink in self.sinks:
            sink.log(m)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
