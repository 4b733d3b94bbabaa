"""The gateway's upstream HTTP clients on their own: client CPU per call, side by side.

    .venv/bin/python bench/upstream_client.py                    # concurrency 16, 6,000 calls, 5 rounds
    .venv/bin/python bench/upstream_client.py --concurrency 1 16 64

A fake vLLM (tests/fakes) in its own process answers `GET /health`; this process calls it in a closed loop
with each client in turn, rounds interleaved, and reads its own CPU time (`time.process_time`) over the
calls: what the client costs the gateway's interpreter per call, the server's share excluded. Sides:
aiohttp's `ClientSession` (what `https://` and task-named URLs use), `polar.gateway.backends.h1` with each
call wrapped in `asyncio.timeout` (a timer per call, as `UpstreamClient` did before 2026-12-05), and h1
with its own `deadline` (one sweep for all calls in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.processes import start  # noqa: E402

from polar.gateway.backends import h1  # noqa: E402
from polar.serving import free_port  # noqa: E402

TIMEOUT_S = 600.0
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


async def closed_loop(call: Callable[[], Awaitable[object]], concurrency: int, calls: int) -> float:
    """Client CPU microseconds per call over `calls` calls, after as many to warm up."""
    left = 0

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call()

    for measured in (False, True):
        left = calls
        t = time.process_time()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        if measured:
            return (time.process_time() - t) / calls * 1e6
    raise AssertionError("unreachable")


async def side(name: str, url: str, concurrency: int, calls: int) -> float:
    loop = asyncio.get_running_loop()
    if name == "aiohttp":
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, headers=HEADERS) as http:

            async def call_aiohttp() -> object:
                async with http.get(url + "/health") as r:
                    return await r.read()

            return await closed_loop(call_aiohttp, concurrency, calls)
    pool = h1.H1Pool(url, HEADERS, 64, 5.0)
    try:
        if name == "h1, asyncio.timeout per call":

            async def call_timer() -> object:
                async with asyncio.timeout(TIMEOUT_S):
                    return await pool.request("GET", "/health", None)

            return await closed_loop(call_timer, concurrency, calls)

        async def call_deadline() -> object:
            return await pool.request("GET", "/health", None, loop.time() + TIMEOUT_S)

        return await closed_loop(call_deadline, concurrency, calls)
    finally:
        await pool.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--calls", type=int, default=6000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fake = start([sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(port)], url)
    sides = ["aiohttp", "h1, asyncio.timeout per call", "h1, deadline swept"]
    got: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(args.repeats):
            for c in args.concurrency:
                for s in sides[r % len(sides) :] + sides[: r % len(sides)]:  # the order rotates
                    got.setdefault((s, c), []).append(asyncio.run(side(s, url, c, args.calls)))
            print(f"round {r + 1}/{args.repeats}", flush=True)
    finally:
        fake.terminate()
        fake.wait(10)
    print(f"\n{args.calls} calls per point, medians of {args.repeats} rounds")
    print("| concurrency | client | client CPU us/call |")
    print("|---:|---|---:|")
    for c in args.concurrency:
        for s in sides:
            print(f"| {c} | {s} | {statistics.median(got[(s, c)]):.1f} |")


if __name__ == "__main__":
    main()
