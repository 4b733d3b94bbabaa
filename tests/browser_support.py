"""Helpers for the dashboard's browser tests: Debian's chromium driven by Playwright (no browser download),
and a `polar run` in the background whose printed dashboard URL a test opens."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
WIDTH, HEIGHT = 1400, 900


def need_browser() -> Any:
    """Skip (with the reason) where chromium or playwright is missing: `scripts/test` installs both."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install 'polar-rl[test]')")
    if not CHROMIUM.exists():
        pytest.skip("chromium is not installed (apt-get install chromium; scripts/test does)")


@contextlib.contextmanager
def browser_page() -> Iterator[Any]:
    need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
            page = context.new_page()
            page.set_default_timeout(60_000)  # a bound on a hung test, not a timing assertion
            page.on("dialog", lambda dialog: dialog.accept())  # the cancel button's confirmation
            yield page
        finally:
            browser.close()


def screenshot(page: Any, name: str) -> None:
    """Take a screenshot of the page (rendering it whole); kept for docs/dashboard.md only when asked:
    `POLAR_SCREENSHOTS=docs/dashboard pytest tests/test_dashboard_browser.py` (a suite run must not rewrite
    tracked files)."""
    folder = os.environ.get("POLAR_SCREENSHOTS")
    image = page.screenshot(full_page=False)
    assert image[:8] == b"\x89PNG\r\n\x1a\n"
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.png").write_bytes(image)


class BackgroundRun:
    """`polar run ARGS` with its stdout read in a thread, so a test can wait for a printed line."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "polar", "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for_line(self, prefix: str, timeout: float = 120.0) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line starting {prefix!r}: {''.join(self.output)}") from None
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def wait(self, timeout: float = 120.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        if self.proc.poll() is None:
            self.proc.kill()
