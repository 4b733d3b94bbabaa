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
    from scripts.compat import CLIS, doc_rows

    rows = doc_rows()
    pinned = {key: line for key, line in rows.items() if "| pinned |" in line}
    assert len(pinned) == len(CLIS), sorted(rows)  # one per preset
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


def test_writing_some_presets_keeps_the_other_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`scripts/compat --only pi --write` replaces Pi's rows, in Pi's place, and leaves every other row; a
    run with other steps than the table's is refused (one table, one scenario)."""
    import scripts.compat as compat

    doc = tmp_path / "compatibility.md"
    doc.write_text(compat.DOC.read_text())
    monkeypatch.setattr(compat, "DOC", doc)
    before = compat.doc_rows()
    cell = compat.Cell("pi", "9.9.9", True, "yes", "5", "0", "1", "5.00x", "none", "ok")
    compat.write([cell], 5, ["pi"])
    after = compat.doc_rows()
    assert {k: v for k, v in after.items() if k[0] != "pi"} == {
        k: v for k, v in before.items() if k[0] != "pi"
    }
    assert after[("pi", "9.9.9")] == cell.line()
    assert [k for k in after if k[0] == "pi"] == [("pi", "9.9.9")]
    presets = [list(dict.fromkeys(h for h, _ in rows)) for rows in (before, after)]
    assert presets[0] == presets[1]  # Pi's row stands where Pi's rows stood
    with pytest.raises(SystemExit, match="other steps"):
        compat.write([cell], 3, ["pi"])
    assert compat.doc_rows() == after


def test_writing_the_pinned_rows_keeps_the_other_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scripts/compat --pinned-only --write` replaces each preset's pinned row (a moved pin too) and keeps
    the rows of every other version."""
    import scripts.compat as compat

    doc = tmp_path / "compatibility.md"
    doc.write_text(compat.DOC.read_text())
    monkeypatch.setattr(compat, "DOC", doc)
    before = compat.doc_rows()
    pins = {h: v for (h, v), line in before.items() if "| pinned |" in line}
    others = {k: v for k, v in before.items() if "| pinned |" not in v}
    assert others  # the committed table has more than the pins, or this proves nothing
    cells = [compat.Cell(h, v, True, "yes", "5", "0", "1", "5.00x", "none", "ok") for h, v in pins.items()]
    moved = compat.Cell("pi", "9.9.9", True, "yes", "5", "0", "1", "5.00x", "none", "ok")
    cells = [c for c in cells if c.harness != "pi"] + [moved]
    compat.write(cells, 5, None, pinned_only=True)
    after = compat.doc_rows()
    assert {k: v for k, v in after.items() if "| pinned |" not in v} == others
    assert {k for k, v in after.items() if "| pinned |" in v} == {
        *((h, v) for h, v in pins.items() if h != "pi"),
        ("pi", "9.9.9"),
    }
    assert all(after[(c.harness, c.version)] == c.line() for c in cells)
