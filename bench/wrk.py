"""Load from `wrk` (C, epoll, one thread): a closed loop of POSTs whose own CPU is a small fraction of the
servers' it measures. bench/gateway.py's aiohttp loop, calling the fake backend with the 7 kB chat body,
spent 0.17 ms of CPU per call at concurrency 1 and 0.12 ms at 16 and held the direct path to 2,700 and
3,900 calls/s; wrk spends 0.036 and 0.019 ms and measures 4,200 and 6,900 (2026-12-04, machine quiet).

Each of `concurrency` connections sends the body, reads the whole answer (for a stream: until its last
chunk, so the latency is the stream's total time, not its time to first token) and sends the next. wrk's
latencies come from bench/wrk.lua's `done()` as one JSON line.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson

SCRIPT = Path(__file__).resolve().parent / "wrk.lua"


@dataclass(frozen=True)
class Load:
    calls: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int  # connect/read/write errors, timeouts and answers other than 2xx/3xx
    client_cpu_s: float  # wrk's own user + system time

    @property
    def rps(self) -> float:
        return self.calls / self.seconds


def find_wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit("bench: wrk is not installed (Debian: apt-get install wrk)")
    return path


def run(url: str, body: bytes, headers: dict[str, str], concurrency: int, seconds: float) -> Load:
    """`concurrency` connections POSTing `body` to `url` for `seconds`."""
    with tempfile.NamedTemporaryFile(prefix="polar-wrk-", suffix=".json") as f:
        f.write(body)
        f.flush()
        argv = [find_wrk(), "-t1", f"-c{concurrency}", f"-d{seconds:g}s", "--timeout", "60s"]
        argv += ["-s", str(SCRIPT), url, "--", f.name, *(f"{k}: {v}" for k, v in headers.items())]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    r = orjson.loads(lines[-1])
    return Load(
        calls=r["requests"],
        seconds=r["duration_us"] / 1e6,
        p50_ms=r["p50_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        errors=sum(r[k] for k in ("connect", "read", "write", "status", "timeout")),
        client_cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
    )
