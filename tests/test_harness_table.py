"""docs/harnesses.md's table is exactly what the presets declare."""

from __future__ import annotations

from pathlib import Path

from polar.harness.table import BEGIN, END, render, rows, update

DOC = Path(__file__).resolve().parent.parent / "docs" / "harnesses.md"


def test_docs_table_matches_the_presets() -> None:
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    assert update(text) == text, "regenerate with: .venv/bin/python -m polar.harness.table"


def test_every_preset_declares_its_row() -> None:
    for row in rows():
        assert all(cell.strip() for cell in row), row
    assert render().startswith(BEGIN)
