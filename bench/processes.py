"""Starting the servers a benchmark measures as processes of their own (so its load generator does not share
their event loop)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx

from polar.serving import free_port

ROOT = Path(__file__).resolve().parent.parent
C = TypeVar("C")
S = TypeVar("S")


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


@dataclass
class Gateway:
    """A `polar gateway` a benchmark started: its process, model API and control URLs, and control token."""

    proc: subprocess.Popen[bytes]
    url: str
    control: str
    token: str

    @property
    def admin(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    def session(self, task_id: str = "bench") -> dict[str, Any]:
        """Open a session (its `session_id` is the model API key; under `--workers`, `base_url` its worker)."""
        made = httpx.post(self.control + "/sessions", json={"task_id": task_id}, headers=self.admin)
        return cast(dict[str, Any], made.raise_for_status().json())

    def stop(self, timeout_s: float = 30) -> None:
        self.proc.terminate()
        self.proc.wait(timeout_s)


def start_gateway(
    backend: str,
    store: Path,
    *extra: str,
    pythonpath: str | None = None,
    log: Path | None = None,
    log_level: str = "warning",
) -> Gateway:
    """`polar gateway` over `backend` (model `m`) with capture into `store`, on free ports, a fresh control
    token; `extra`: more of its options (`--workers 2`). Returns once it answers."""
    port, cport = free_port(), free_port()
    url, control = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{cport}"
    token = secrets.token_urlsafe(32)
    argv = [sys.executable, "-m", "polar", "gateway", "--backend", backend, "--model", "m"]
    argv += ["--port", str(port), "--control-port", str(cport), "--store", str(store)]
    argv += ["--log-level", log_level, *extra]
    proc = start(argv, url, {"POLAR_TOKEN": token}, pythonpath=pythonpath, log=log)
    return Gateway(proc, url, control, token)


def rotation(cells: Sequence[C], sides: Sequence[S], round_: int) -> Iterator[tuple[C, S]]:
    """One round of a side-by-side benchmark: every cell for each side in turn, the order of the sides
    rotating with each cell and round, so that a busy moment of this shared machine falls on every side
    alike rather than always on the one measured first."""
    for i, cell in enumerate(cells):
        k = (round_ + i) % len(sides)
        for side in [*sides[k:], *sides[:k]]:
            yield cell, side
