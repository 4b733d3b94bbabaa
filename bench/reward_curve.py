"""Train on examples/learn (CPU, the offline tiny policy) and plot reward per step.

    python bench/reward_curve.py                      # train, then write docs/reward_curve.svg
    python bench/reward_curve.py --metrics run/metrics.jsonl   # only plot an existing run
    python bench/reward_curve.py --set pace=false --svg /tmp/unpaced.svg   # any config field, as polar train

Prints one row per step (reward, tokens, staleness, time) and the mean reward of the first five steps
against the last five. The plot is drawn by matplotlib (the `bench` extra: pip install 'polar-rl[bench]').
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "learn" / "train.yaml"
SVG = ROOT / "docs" / "reward_curve.svg"


def run(config: Path, out: Path, steps: int | None, sets: list[str]) -> Path:
    """Train with `polar train`'s own entry point, in this process (the evaluator is imported from the
    repository root, which is put on `sys.path` here)."""
    sys.path.insert(0, str(ROOT))
    from polar.train.config import load_config, parse_override
    from polar.train.loop import train

    cfg, tasks = load_config(config, [parse_override(s) for s in sets])
    updates: dict[str, Any] = {"out": str(out)}
    if steps is not None:
        updates["steps"] = steps
    train(cfg.model_copy(update=updates), tasks)
    return out / "metrics.jsonl"


def read(metrics: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in metrics.read_bytes().splitlines() if line.strip()]


def table(rows: list[dict[str, Any]]) -> str:
    head = "| step | version | reward_mean | groups | zero-var groups | stale (mean) | train s |"
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['policy_version']} | {r['reward_mean']:.3f} | {r['groups']} "
            f"| {r['zero_variance_groups']} | {r['staleness_mean']:.1f} | {r['train_s']:.1f} |"
        )
    return "\n".join(lines)


PACING_KEYS = ("dropped_stale_groups", "staleness_mean", "rollout_wait_s", "train_s", "sync_s")


def pacing(rows: list[dict[str, Any]], wall_s: float | None) -> str | None:
    """What staleness cost the run: groups dropped, the staleness trained on, the time per step (None for
    a file that lacks those keys: a run of an older polar)."""
    if not all(k in r for r in rows for k in PACING_KEYS):
        return None
    dropped = sum(r["dropped_stale_groups"] for r in rows)
    stale = sum(r["staleness_mean"] for r in rows) / len(rows)
    step_s = sorted(r["rollout_wait_s"] + r["train_s"] + r["sync_s"] for r in rows)[len(rows) // 2]
    wall = f"   wall {wall_s:.0f} s" if wall_s is not None else ""
    return f"dropped stale groups {dropped}   staleness trained on (mean) {stale:.2f}   step s (median) {step_s:.1f}{wall}"


def summary(rows: list[dict[str, Any]], k: int = 5) -> tuple[float, float]:
    first = [r["reward_mean"] for r in rows[:k]]
    last = [r["reward_mean"] for r in rows[-k:]]
    return sum(first) / len(first), sum(last) / len(last)


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Reward per step as a line with markers, y axis within 0..1 (rewards are shares), as SVG at `path`.
    Text stays text and the file carries no date, so the same metrics give the same file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    ys = [r["reward_mean"] for r in rows]
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "polar", "font.size": 9}):
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        ax.plot(steps, ys, marker="o", markersize=3, linewidth=1.5, color="#1f77b4")
        ax.set_ylim(max(0.0, round(min(ys) - 0.1, 1)), min(1.0, round(max(ys) + 0.1, 1)))
        ax.set_xlabel("training step")
        ax.set_ylabel("reward_mean")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", color="#e5e5e5")
        ax.xaxis.get_major_locator().set_params(integer=True)
        fig.tight_layout()
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--metrics", type=Path, help="plot this metrics.jsonl instead of training")
    parser.add_argument("--out", type=Path, help="training output folder (default: a temporary one)")
    parser.add_argument("--steps", type=int, help="override the config's steps")
    parser.add_argument("--svg", type=Path, default=SVG)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    wall_s = None
    if args.metrics is not None:
        metrics = args.metrics
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="polar-reward-curve-"))
        started = time.monotonic()
        metrics = run(args.config, out, args.steps, args.sets)
        wall_s = time.monotonic() - started
    rows = read(metrics)
    if not rows:
        raise SystemExit(f"{metrics}: no steps recorded")
    print(table(rows))
    first, last = summary(rows)
    print(
        f"\nreward_mean, first 5 steps: {first:.3f}   last 5 steps: {last:.3f}   change: {last - first:+.3f}"
    )
    cost = pacing(rows, wall_s)
    if cost is not None:
        print(cost)
    args.svg.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, f"GRPO on CPU, tiny policy: reward per step ({first:.2f} → {last:.2f})", args.svg)
    print(f"plot: {args.svg}")


if __name__ == "__main__":
    main()
