"""Starting the servers a benchmark measures as processes of their own (so its load generator does not share
their event loop)."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start(
    cmd: list[str], url: str, env: dict[str, str] | None = None, *, pythonpath: str | None = None
) -> subprocess.Popen[bytes]:
    """Run `cmd` from the repository root and return once `url/health` answers (60 s at most).

    `pythonpath`: what the process imports polar (and tests.fakes) from; default this checkout."""
    path = pythonpath if pythonpath is not None else f"{ROOT}:{ROOT / 'src'}"
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path, **(env or {})})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{cmd} did not start")
