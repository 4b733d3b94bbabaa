"""Run `polar` in a subprocess where some packages cannot be imported, as if they were not installed.

`tests/block_imports/sitecustomize.py` (first on the subprocess's PYTHONPATH) refuses the packages named in
POLAR_BLOCK_IMPORTS; nothing in the product path is patched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "block_imports"


def env_without(*packages: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "POLAR_BLOCK_IMPORTS": ",".join(packages),
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "200",
    }


def polar_without(
    packages: tuple[str, ...], *args: str, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m polar ARGS` with `packages` unimportable."""
    return subprocess.run(
        [sys.executable, "-m", "polar", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_without(*packages),
        cwd=cwd,
    )


def python_without(
    packages: tuple[str, ...], code: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_without(*packages),
    )


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The single `Error: ...` line a usage error prints (exit status 2, no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    return lines[0]
