"""Helpers shared by CLI commands."""

from __future__ import annotations

import logging

from rich.logging import RichHandler


def setup_logging(level: str = "info") -> None:
    """Readable logs on stderr: time, level, logger, message."""
    logging.basicConfig(
        level=level.upper(),
        format="%(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[RichHandler(show_path=False, rich_tracebacks=False)],
        force=True,
    )
