"""The pinned row of every harness CLI in docs/compatibility.md still holds: `scripts/compat --pinned-only`
runs each pinned release through the depth scenario, and a row that differs from the committed table fails
(a changed CLI, or a change in polar, shows here). Needs npm, like the CLI tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.mark.cli
@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is needed to install the CLIs")
def test_the_pinned_rows_of_the_version_matrix_hold() -> None:
    from scripts.compat import doc_rows

    rows = doc_rows()
    pinned = {key: line for key, line in rows.items() if "| pinned |" in line}
    assert len(pinned) == 7, sorted(rows)  # one per preset
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compat.py"), "--pinned-only", "--steps", "5"],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = {line.strip() for line in done.stdout.splitlines() if "| pinned |" in line}
    assert got == set(pinned.values()), (sorted(got), sorted(pinned.values()))
