"""The training page's data: `OUT/metrics.jsonl` of a `polar train` run, as one series per key.

The file is read whole on each request (one line per optimizer step: small), so the curves follow a run
that is still training. A line that is not JSON (a run killed mid-write) is skipped and counted; keys are
those of `polar.train.metrics.METRICS` (docs/reference/metrics.md), and unknown ones are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

EVAL_TITLE = "held-out accuracy (95 % interval)"

# The charts, in page order: (title, keys on one chart).
CHARTS: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward_mean", "reward_std")),  # drawn as mean with a ± std band (`_reward_band`)
    ("pass rate", ("pass_rate",)),
    # Only at evaluation steps (`eval.every`): drawn at those steps, the interval as a band (`_sparse_band`).
    (EVAL_TITLE, ("eval_accuracy", "eval_accuracy_high", "eval_accuracy_low")),
    # Groups that cost rollouts and gave no gradient: too old, all rewards equal (trained on or filtered).
    (
        "groups dropped or without signal",
        (
            "dropped_stale_groups",
            "zero_variance_groups",
            "filtered_zero_variance_groups",
            "filtered_masked_groups",
        ),
    ),
    ("broken tool calls (traces)", ("tool_call_parse_errors",)),
    ("staleness (policy versions)", ("staleness_mean", "staleness_max")),
    ("tokens per step", ("tokens", "trainable_tokens")),
    ("policy version", ("policy_version",)),
    ("loss and KL", ("loss", "kl")),
    ("gradient norm (before clipping)", ("grad_norm",)),
    ("learning rate", ("lr",)),
]


@dataclass
class TrainingRun:
    path: Path
    steps: list[int] = field(default_factory=list)
    series: dict[str, list[float | None]] = field(default_factory=dict)
    skipped: int = 0
    error: str | None = None

    def charts(self) -> list[dict[str, Any]]:
        """uPlot-ready data for each chart that has at least one of its keys."""
        out = []
        for title, keys in CHARTS:
            present = [k for k in keys if k in self.series]
            if not present:
                continue
            chart: dict[str, Any] = {
                "title": title,
                "x": self.steps,
                "series": {k: self.series[k] for k in present},
            }
            if title == "reward":
                _reward_band(chart)
            elif title == EVAL_TITLE:
                _sparse_band(chart)
            out.append(chart)
        return out

    @property
    def last(self) -> dict[str, float | None]:
        return {k: v[-1] for k, v in self.series.items() if v}


def _reward_band(chart: dict[str, Any]) -> None:
    """mean ± std as two dashed lines with the band between them filled (uPlot `bands`), instead of the
    std as a line of its own on the reward's scale, where it reads as a second reward."""
    series = chart["series"]
    if "reward_mean" not in series or "reward_std" not in series:
        return
    std = series.pop("reward_std")
    mean = series["reward_mean"]
    series["mean + std"] = [_add(m, s, 1) for m, s in zip(mean, std, strict=True)]
    series["mean - std"] = [_add(m, s, -1) for m, s in zip(mean, std, strict=True)]
    chart["band"] = ["mean + std", "mean - std"]


def _sparse_band(chart: dict[str, Any]) -> None:
    """The held-out accuracy at the steps that were evaluated (the others have none: no gaps drawn), its
    interval as the band."""
    series = chart["series"]
    keep = [i for i, v in enumerate(series.get("eval_accuracy", [])) if v is not None]
    chart["x"] = [chart["x"][i] for i in keep]
    chart["series"] = {k: [v[i] for i in keep] for k, v in series.items()}
    if {"eval_accuracy_low", "eval_accuracy_high"} <= set(series):
        chart["band"] = ["eval_accuracy_high", "eval_accuracy_low"]


def _add(mean: float | None, std: float | None, sign: int) -> float | None:
    return None if mean is None or std is None else mean + sign * std


def metrics_file(out: Path) -> Path:
    """An out folder or the file itself."""
    return out / "metrics.jsonl" if out.is_dir() else out


def read_run(out: Path) -> TrainingRun:
    path = metrics_file(out)
    run = TrainingRun(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if not path.parent.is_dir():
            run.error = f"{path.parent}: no such folder"
        return run  # a run that has not finished its first step yet
    except OSError as exc:
        run.error = f"{path}: cannot read: {exc.strerror}"
        return run
    rows: list[dict[str, Any]] = []
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            run.skipped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            run.skipped += 1
    keys = sorted({k for r in rows for k, v in r.items() if k != "step" and _number(v)})
    run.steps = [r["step"] for r in rows]
    run.series = {k: [r[k] if _number(r.get(k)) else None for r in rows] for k in keys}
    return run


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
