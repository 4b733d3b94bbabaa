"""bench/gateway.py's side-by-side machinery: the servers measured, wrk's rounds over them, the tables.

`Side` is one server (direct: the fake backend itself; polar; LiteLLM), `rounds` runs every (path,
concurrency) cell for each side in turn, the order rotating, and `print_table` gives medians over rounds.
The memory part runs bench/soak.py's idle baseline and burst on each measured side at once.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from bench import soak, wrk
from bench.processes import cpu_seconds, rotation, rss_mib

Bodies = Callable[[bool], dict[str, tuple[str, dict[str, Any]]]]  # bench.gateway.bodies

PATHS = {  # name: (dialect, stream)
    "chat": ("chat", False),
    "chat-stream": ("chat", True),
    "anthropic": ("anthropic", False),
    "anthropic-stream": ("anthropic", True),
    "responses": ("responses", False),
    "responses-stream": ("responses", True),
    "gemini": ("gemini", False),
    "gemini-stream": ("gemini", True),
}
LITELLM_PATHS = {"chat", "chat-stream", "anthropic", "anthropic-stream"}  # the routes checked with it


def base(path: str) -> str:
    """The direct call a path is compared with: the backend's own chat call, in the same mode."""
    return "chat-stream" if PATHS[path][1] else "chat"


@dataclass
class Side:
    """One server measured: its base URL, the process whose CPU and memory are read, its key, and where
    it captures (the gateway: its control listener; LiteLLM: its callback's file)."""

    name: str
    url: str
    pid: int
    key: str
    control: str = ""
    token: str = ""
    capture: Path | None = None
    started_s: float = 0.0
    started_mib: float = 0.0
    points: dict[tuple[str, int], list[dict[str, float]]] = field(default_factory=dict)
    answered: int = 0
    memory: dict[str, float] = field(default_factory=dict)

    def sessions(self) -> soak.Sessions:
        """How bench/soak.py's burst opens and closes a session here (a proxy without sessions: one key)."""
        return soak.GatewaySessions(self.control, self.token) if self.control else FixedKey(self.key)

    def records(self) -> int | None:
        """Calls captured on this side's key: the gateway's count for the session (asked over its control
        API: the bench never opens the store while the gateway runs), LiteLLM's callback's lines."""
        if self.control:
            admin = {"authorization": f"Bearer {self.token}"}
            got = httpx.get(f"{self.control}/sessions/{self.key}", headers=admin).raise_for_status()
            return int(got.json()["completions"])
        if self.capture is not None:
            with self.capture.open("rb") as f:
                return sum(1 for _ in f)
        return None

    def request(self, path: str, bodies: Bodies) -> tuple[str, bytes, dict[str, str]] | None:
        """What this side is sent for `path`; None where it is not measured."""
        dialect, stream = PATHS[path]
        if (self.name == "direct" and path != base(path)) or (
            self.name == "LiteLLM" and path not in LITELLM_PATHS
        ):
            return None
        route, body = bodies(stream)[dialect]
        if dialect == "anthropic":
            headers = {"x-api-key": self.key, "anthropic-version": "2023-06-01"}
        else:
            headers = {"authorization": f"Bearer {self.key}"}
        return self.url + route, orjson.dumps(body), {**headers, "content-type": "application/json"}


def measure(side: Side, path: str, concurrency: int, seconds: float, bodies: Bodies) -> None:
    req = side.request(path, bodies)
    if req is None:
        return
    url, body, headers = req
    before = cpu_seconds(side.pid)
    got = wrk.run(url, body, headers, concurrency, seconds)
    used = cpu_seconds(side.pid) - before
    side.answered += got.calls
    if got.errors:
        print(f"  {side.name} {path} c={concurrency}: {got.errors} errors, {got.calls} calls", flush=True)
    point = {"rps": got.rps, "p50": got.p50_ms, "p99": got.p99_ms, "errors": got.errors}
    point["cpu_ms"] = used / max(1, got.calls) * 1000
    point["client_ms"] = got.client_cpu_s / max(1, got.calls) * 1000
    side.points.setdefault((path, concurrency), []).append(point)


def rounds(sides: list[Side], opts: argparse.Namespace, bodies: Bodies) -> None:
    """Every (path, concurrency) cell for each side in turn (`rotation`), `opts.rounds` times."""
    cells = [(p, c) for p in opts.paths for c in opts.concurrency]
    for r in range(opts.rounds):
        t = time.monotonic()
        for (path, c), side in rotation(cells, sides, r):
            measure(side, path, c, opts.seconds, bodies)
        print(f"round {r + 1}/{opts.rounds}: {time.monotonic() - t:.0f} s, load {load_average()}", flush=True)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def print_table(sides: list[Side], opts: argparse.Namespace) -> None:
    direct = sides[0]

    def med(side: Side, path: str, c: int, key: str) -> float:
        return statistics.median(m[key] for m in side.points[(path, c)])

    print(f"\n{opts.seconds:g} s of wrk per point, medians of {opts.rounds} interleaved rounds")
    print(
        "| path | conc | side | calls/s | vs direct | CPU ms/call | p50 ms | p99 ms | p99/p50 | wrk ms/call |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in opts.paths:
        for c in opts.concurrency:
            for side in sides:
                if (path, c) not in side.points:
                    continue
                rps, p50, p99 = (med(side, path, c, k) for k in ("rps", "p50", "p99"))
                ratio = "" if side is direct else f"{rps / med(direct, base(path), c, 'rps'):.2f}x"
                errors = sum(m["errors"] for m in side.points[(path, c)])
                print(
                    f"| {path} | {c} | {side.name} | {rps:.0f} | {ratio} | {med(side, path, c, 'cpu_ms'):.3f} | "
                    f"{p50:.2f} | {p99:.2f} | {p99 / p50:.1f} | {med(side, path, c, 'client_ms'):.3f} |"
                    + (f" {errors:.0f} errors" if errors else "")
                )


# ---- memory: idle, a burst of sessions (bench/soak.py's), a minute after it went idle ----


async def memory_baseline(sides: list[Side], opts: argparse.Namespace) -> None:
    """Each measured side serves soak's warm-up (16 sessions, 8 at a time) and lets them go idle (soak's idle
    baseline), together."""
    base_msgs = soak.base_history(opts.tokens - 2000)
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(
            *(soak.idle_baseline(client, s.url, s.sessions(), base_msgs, opts.idle_s) for s in sides)
        )
    for s in sides:
        s.memory["baseline"] = rss_mib(s.pid)


async def memory_burst(sides: list[Side], opts: argparse.Namespace) -> float:
    """`--burst` sessions on each side at once (soak's sessions: ~60k-token histories, two calls, three in
    four closed), the peak RSS sampled; then idle until the last sessions were evicted and `--after-s`
    more after each side's own burst. Returns the seconds waited idle."""
    base_msgs = soak.base_history(opts.tokens - 2000)
    for s in sides:
        s.memory["peak"] = rss_mib(s.pid)

    def tick(side: Side) -> Callable[[int], None]:
        def sample(done: int) -> None:
            side.memory["peak"] = max(side.memory["peak"], rss_mib(side.pid))
            if done >= opts.burst // 10 and "warm" not in side.memory:
                side.memory["warm"] = rss_mib(side.pid)

        return sample

    t = time.monotonic()
    wait = soak.idle_wait_s(opts.idle_s, opts.after_s)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(side: Side) -> None:
            await soak.burst(client, side.url, side.sessions(), base_msgs, opts.burst, 8, tick(side))
            side.memory["burst_s"] = time.monotonic() - t
            await asyncio.sleep(wait)
            side.memory["after"] = rss_mib(side.pid)

        await asyncio.gather(*(one(s) for s in sides))
    return wait


def print_memory(sides: list[Side], opts: argparse.Namespace, wait: float) -> None:
    print(
        f"\nRSS (MiB) of each server process: started; idle baseline (16 sessions gone idle); peak during a "
        f"burst of {opts.burst} sessions of ~{opts.tokens // 1000}k tokens; {wait:.0f} s after it went idle"
    )
    print(
        "| side | start s | at start | idle baseline | burst s | peak | after idle | vs baseline | verdict |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for s in sides:
        m = s.memory
        # Live sessions are not read here (LiteLLM has none to read): the wait covers their eviction.
        verdict = soak.verdict(m["baseline"], [[soak.Sample(wait, None, m["after"])]]).label
        print(
            f"| {s.name} | {s.started_s:.1f} | {s.started_mib:.0f} | {m['baseline']:.1f} | {m['burst_s']:.0f} | "
            f"{m['peak']:.1f} | {m['after']:.1f} | {100 * (m['after'] / m['baseline'] - 1):+.0f} % | {verdict} |"
        )


@dataclass
class FixedKey:
    """bench/soak.py's sessions for a proxy without them: every session is the one key."""

    key: str

    async def open(self, client: httpx.AsyncClient) -> str:
        return self.key

    async def close(self, client: httpx.AsyncClient, key: str) -> None:
        return None
