"""docs/harnesses.md's table is exactly what the presets declare."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar.harness.table import BEGIN, END, EXT_BEGIN, EXT_END, extension_rows, main, render, rows, update

DOC = Path(__file__).resolve().parent.parent / "docs" / "harnesses.md"


def test_docs_table_matches_the_presets() -> None:
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    assert text.count(EXT_BEGIN) == 1 and text.count(EXT_END) == 1
    assert update(text) == text, "regenerate with: .venv/bin/python -m polar.harness.table"


def test_every_preset_declares_its_row() -> None:
    for row in rows():
        assert all(cell.strip() for cell in row), row
    assert render().startswith(BEGIN)
    for name, mcp, _, skills in extension_rows():
        assert mcp and skills, name


def test_help_and_check_change_nothing(tmp_path: Path) -> None:
    doc = tmp_path / "harnesses.md"
    stale = f"intro\n{BEGIN}\n| old |\n{END}\nrest\n"
    doc.write_text(stale)
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0 and doc.read_text() == stale
    assert main(["--check", "--doc", str(doc)]) == 1 and doc.read_text() == stale
    assert main(["--doc", str(doc)]) == 0 and doc.read_text() == update(stale)
    assert main(["--check", "--doc", str(doc)]) == 0
