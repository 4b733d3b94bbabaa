"""docs/reference, generated from the code it documents: `python -m polar.docs` writes it, `--check` compares.

Pydantic models document their own fields (`Field(description=...)`), `polar.train.metrics.METRICS` the
metrics keys, `polar.docs.keys` the keys of free-form mappings, `polar.train.names` the TRL/verl names; the
example lines come from polar's own builder, reward rules and node code (`polar.docs.example`). A test
regenerates every page and fails on any difference, so the reference cannot drift from the code.
"""

from __future__ import annotations

from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "reference"


def render_all() -> dict[str, str]:
    """Every page's file name and Markdown."""
    from polar.docs.pages import PAGES

    return {name: page() for name, page in PAGES.items()}


def stale(folder: Path = REFERENCE) -> list[str]:
    """Pages in `folder` that differ from what the code generates (or are missing), and stray files."""
    pages = render_all()
    out = [n for n, text in pages.items() if not (folder / n).is_file() or (folder / n).read_text() != text]
    if folder.is_dir():
        out += sorted(p.name for p in folder.glob("*.md") if p.name not in pages)
    return out


def write(folder: Path = REFERENCE) -> list[str]:
    """Write every page into `folder` and remove pages no longer generated; the names written."""
    pages = render_all()
    folder.mkdir(parents=True, exist_ok=True)
    for p in folder.glob("*.md"):
        if p.name not in pages:
            p.unlink()
    for name, text in pages.items():
        (folder / name).write_text(text)
    return list(pages)
