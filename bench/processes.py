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
    cmd: list[str],
    url: str,
    env: dict[str, str] | None = None,
    *,
    pythonpath: str | None = None,
    health: str = "/health",
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Run `cmd` from the repository root and return once `url` + `health` answers (60 s at most).

    `pythonpath`: what the process imports polar (and tests.fakes) from; default this checkout. `log`: a
    file for its output (default: this process's)."""
    path = pythonpath if pythonpath is not None else f"{ROOT}:{ROOT / 'src'}"
    out = log.open("ab") if log is not None else None
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path, **(env or {})}, stdout=out, stderr=out
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + health, timeout=1):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{cmd} did not start" + (f" (its output: {log})" if log else ""))


def tree(pid: int) -> list[int]:
    """`pid` and its live descendants (a server that forks workers is measured whole)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` and its descendants, all threads (/proc/PID/stat)."""
    total = 0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its descendants, MiB (VmRSS)."""
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024
