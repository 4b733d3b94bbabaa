"""Train on examples/learn (CPU, the offline tiny policy) and plot reward per step.

    python bench/reward_curve.py                      # train, then write docs/reward_curve.svg
    python bench/reward_curve.py --metrics run/metrics.jsonl   # only plot an existing run

Prints one row per step (reward, tokens, staleness, time) and the mean reward of the first five steps
against the last five. The SVG is written by hand (a polyline with axes), so plotting needs nothing new.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "learn" / "train.yaml"
SVG = ROOT / "docs" / "reward_curve.svg"


def run(config: Path, out: Path, steps: int | None) -> Path:
    """Train with `polar train`'s own entry point, in this process (the evaluator is imported from the
    repository root, which is put on `sys.path` here)."""
    sys.path.insert(0, str(ROOT))
    from polar.train.config import load_config
    from polar.train.loop import train

    cfg, tasks = load_config(config)
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


def summary(rows: list[dict[str, Any]], k: int = 5) -> tuple[float, float]:
    first = [r["reward_mean"] for r in rows[:k]]
    last = [r["reward_mean"] for r in rows[-k:]]
    return sum(first) / len(first), sum(last) / len(last)


def svg(rows: list[dict[str, Any]], title: str) -> str:
    """Reward per step as a polyline with markers, y axis 0..1 (rewards are shares), ticks every 0.1."""
    w, h, left, right, top, bottom = 640, 360, 56, 16, 36, 44
    pw, ph = w - left - right, h - top - bottom
    steps = [r["step"] for r in rows]
    lo, hi = min(steps), max(steps)
    ys = [r["reward_mean"] for r in rows]
    y_lo = max(0.0, round(min(ys) - 0.1, 1))
    y_hi = min(1.0, round(max(ys) + 0.1, 1))

    def x(step: float) -> float:
        return left + (step - lo) / max(hi - lo, 1) * pw

    def y(v: float) -> float:
        return top + (y_hi - v) / (y_hi - y_lo) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
    ]
    n_ticks = round((y_hi - y_lo) / 0.1)
    for i in range(n_ticks + 1):
        v = y_lo + i * 0.1
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{w - right}" y2="{y(v):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>')
    every = max(1, (hi - lo) // 10)
    for s in range(lo, hi + 1, every):
        out.append(f'<text x="{x(s):.1f}" y="{h - bottom + 16}" text-anchor="middle">{s}</text>')
    out.append(
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>'
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>'
    )
    out.append(f'<text x="{left + pw / 2}" y="{h - 8}" text-anchor="middle">training step</text>')
    out.append(
        f'<text x="14" y="{top + ph / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {top + ph / 2})">reward_mean</text>'
    )
    points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps, ys, strict=True))
    out.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    out.extend(
        f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5" fill="#1f77b4"/>'
        for s, v in zip(steps, ys, strict=True)
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--metrics", type=Path, help="plot this metrics.jsonl instead of training")
    parser.add_argument("--out", type=Path, help="training output folder (default: a temporary one)")
    parser.add_argument("--steps", type=int, help="override the config's steps")
    parser.add_argument("--svg", type=Path, default=SVG)
    args = parser.parse_args()
    if args.metrics is not None:
        metrics = args.metrics
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="polar-reward-curve-"))
        metrics = run(args.config, out, args.steps)
    rows = read(metrics)
    if not rows:
        raise SystemExit(f"{metrics}: no steps recorded")
    print(table(rows))
    first, last = summary(rows)
    print(
        f"\nreward_mean, first 5 steps: {first:.3f}   last 5 steps: {last:.3f}   change: {last - first:+.3f}"
    )
    args.svg.parent.mkdir(parents=True, exist_ok=True)
    args.svg.write_text(svg(rows, f"GRPO on CPU, tiny policy: reward per step ({first:.2f} → {last:.2f})"))
    print(f"plot: {args.svg}")


if __name__ == "__main__":
    main()
