"""`bench/reward_curve.py --metrics FILE`: an existing run's metrics plotted (by matplotlib) without
training, the way docs/reward_curve.svg is made; the same metrics give the same file."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]


def plot(metrics: Path, svg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "reward_curve.py"),
            "--metrics",
            str(metrics),
            "--svg",
            str(svg),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MPLCONFIGDIR": str(svg.parent / "mpl")},
    )


def test_plots_an_existing_run(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"step": s, "policy_version": s, "reward_mean": 0.5 + 0.02 * s, "groups": 4, "zero_variance_groups": 0,
         "staleness_mean": 1.0, "train_s": 5.0}
        for s in range(1, 11)
    ]  # fmt: skip
    metrics.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    proc = plot(metrics, first)
    assert proc.returncode == 0, proc.stderr
    assert "| 10 | 10 | 0.700 | 4 | 0 | 1.0 | 5.0 |" in proc.stdout
    assert "first 5 steps: 0.560   last 5 steps: 0.660" in proc.stdout
    assert "dropped stale groups" not in proc.stdout  # a file without the keys: no pacing line, no error
    text = first.read_text()
    root = ET.fromstring(text)
    assert root.tag == "{http://www.w3.org/2000/svg}svg" and "Matplotlib" in text
    assert "reward per step (0.56 → 0.66)" in text and "training step" in text  # text kept as text
    assert plot(metrics, second).returncode == 0
    assert second.read_bytes() == first.read_bytes()  # no date, fixed ids: regenerating changes nothing


def test_an_empty_run_is_refused(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    proc = plot(metrics, tmp_path / "a.svg")
    assert proc.returncode == 1 and "no steps recorded" in proc.stderr


def test_says_what_staleness_cost_the_run(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"step": s, "policy_version": s, "reward_mean": 0.5, "groups": 4, "zero_variance_groups": 0,
         "staleness_mean": 1.0 if s > 1 else 0.0, "train_s": 5.0, "rollout_wait_s": 2.0, "sync_s": 1.0,
         "dropped_stale_groups": 3 if s in (4, 6) else 0}
        for s in range(1, 11)
    ]  # fmt: skip
    metrics.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    proc = plot(metrics, tmp_path / "a.svg")
    assert proc.returncode == 0, proc.stderr
    assert "dropped stale groups 6   staleness trained on (mean) 0.90   step s (median) 8.0" in proc.stdout
