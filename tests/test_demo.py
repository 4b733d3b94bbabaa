"""`polar demo`, the first command of the README's `scripts/demo`, end to end as a user runs it: the embedded
engine, the gateway, the SDK-driven sessions, the audit and the export, on an 80-column terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest


def demo(out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "polar", "demo", "--out", str(out), "--turns", "2"]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow  # loads the embedded engine's model twice
def test_the_demo_twice_fits_80_columns_and_exports_every_session(tmp_path: Path) -> None:
    out = tmp_path / "polar-demo"
    first = demo(out)
    assert first.returncode == 0, first.stdout + first.stderr
    # Was: its table of 9 columns was cut to "respons…" and "anthrop…" at 80 columns.
    lines = first.stdout.splitlines()
    table = lines[lines.index(next(x for x in lines if "captured sessions" in x)) :]
    table = table[: table.index(next(x for x in table if x.startswith("traces: ")))]
    assert "…" not in first.stdout and max(len(line) for line in table) <= 80, first.stdout
    for dialect in ("chat", "responses", "anthropic", "gemini"):
        assert f"\n{dialect} " in first.stdout, first.stdout
    assert first.stdout.count(" ok") >= 4  # every session's audit passed
    # The gateway renders (token-in): the two-turn chat session is one trace (was "2 / 2", context drift).
    chat = next(line for line in lines if line.startswith("chat "))
    assert " 2 / 1 " in chat, first.stdout

    def sessions() -> set[str]:
        rows = [orjson.loads(line) for line in (out / "trajectories.jsonl").read_bytes().splitlines()]
        return {row["session_id"] for row in rows}

    assert len(sessions()) == 4
    # Was: a second demo overwrote trajectories.jsonl while polar.db kept both runs' sessions.
    second = demo(out)
    assert second.returncode == 0, second.stdout + second.stderr
    assert len(sessions()) == 8 and "(8 sessions, 4 of them from earlier demos)" in second.stdout
    # The printed inspect command runs as printed (was: `polar`, which is not on PATH after scripts/demo).
    inspect = next(line for line in second.stdout.splitlines() if line.startswith("inspect: "))
    argv = inspect.removeprefix("inspect: ").split()
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
