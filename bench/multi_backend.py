"""Several inference servers behind one gateway: one server vs two, and session affinity on vs off.

Agent sessions (a shared system prompt, then a history that grows by a tool output every turn) run through a
gateway over one server, over two with session affinity, and over two without it. For each it prints calls
per second, p50/p99 call latency, and the prefix-cache hit rate (prompt tokens served from cache over prompt
tokens looked up, summed over the servers, from their `/metrics` counters `vllm:prefix_cache_hits` and
`vllm:prefix_cache_queries`).

    .venv/bin/python bench/multi_backend.py             # fake servers (tests/fakes), seconds
    .venv/bin/python bench/multi_backend.py --vllm DIR  # two real `vllm serve DIR` (tests/vllm_support.py)

With fakes, the servers are a *model*: each runs `--slots` calls at once, and a call takes `--decode-ms` plus
`--uncached-us` per prompt token its prefix cache (tests/fakes/prefix_cache.py, vLLM's block-hash scheme)
misses. It shows what the placement does under those assumptions; the hit rate of a real server comes only
from `--vllm`, which needs `tests/vllm_support.py` (the real-vLLM test support) and its cached venv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from polar.auth import new_token  # noqa: E402
from polar.gateway.app import create_app  # noqa: E402
from polar.gateway.backends.base import BackendOptions  # noqa: E402
from polar.gateway.config import GatewayConfig  # noqa: E402
from polar.serving import serve  # noqa: E402

SYSTEM = "You are a coding agent working in a repository. Follow its conventions. " * 40
TOOL_OUT = "tests/test_parser.py::test_trailing_comma FAILED\nE   AssertionError: parse error near ','\n" * 20
_COUNTER = re.compile(r"^vllm:prefix_cache_(hits|queries)(?:_total)?(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


@dataclass
class Result:
    name: str
    calls: int
    seconds: float
    latencies: list[float]
    hits: float
    queries: float

    def row(self) -> str:
        lat = sorted(self.latencies)
        p50 = statistics.median(lat) * 1000
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
        rate = f"{self.hits / self.queries:.1%}" if self.queries else "-"
        return (
            f"| {self.name} | {self.calls / self.seconds:.1f} | {p50:.0f} | {p99:.0f} | {rate} | "
            f"{self.seconds:.1f} |"
        )


def prefix_counters(url: str) -> tuple[float, float]:
    """(hits, queries) of a server's prefix cache, from its Prometheus `/metrics`."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals = {"hits": 0.0, "queries": 0.0}
    for name, value in _COUNTER.findall(text):
        totals[name] += float(value)
    return totals["hits"], totals["queries"]


@contextlib.contextmanager
def fake_servers(args: argparse.Namespace) -> Iterator[tuple[list[str], str, Any]]:
    from tests.fakes.fake_vllm import make_fake_backend
    from tests.fakes.prefix_cache import PrefixCache

    apps = []
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(2):
            app = make_fake_backend(
                "vllm",
                record=False,
                bytes_per_token=4,
                slots=args.slots,
                prefix_cache=PrefixCache(capacity_blocks=args.cache_blocks),
                uncached_token_s=args.uncached_us / 1e6,
                decode_s=args.decode_ms / 1000,
            )
            apps.append(app)
            urls.append(stack.enter_context(serve(app)).url)

        def reset() -> None:
            for app in apps:
                app.prefix_cache = PrefixCache(capacity_blocks=args.cache_blocks)

        yield urls, "fake-model", reset


@contextlib.contextmanager
def vllm_servers(args: argparse.Namespace) -> Iterator[tuple[list[str], str, Any]]:
    try:
        from tests.vllm_support import start_vllm
    except ImportError:
        sys.exit("--vllm needs tests/vllm_support.py (the real-vLLM test support), which is not here yet")
    logs = Path(tempfile.mkdtemp(prefix="polar-bench-vllm-"))
    servers = []
    try:
        for i in range(2):
            # One core each where there are two (vLLM's `auto` binds every server to core 0 here).
            cpus = str(i % (os.cpu_count() or 1)) if args.spread_cores else None
            servers.append(start_vllm(Path(args.vllm), logs, cpus=cpus))
            print(f"vllm at {servers[-1].url} ready in {servers[-1].startup_s:.0f} s (log {servers[-1].log})")

        def reset() -> None:  # a cold cache for every configuration (dev-mode route)
            for s in servers:
                httpx.post(f"{s.url}/reset_prefix_cache", timeout=60).raise_for_status()

        yield [s.url for s in servers], servers[0].name, reset
    finally:
        for s in servers:
            s.stop()


async def session(
    client: httpx.AsyncClient, gw: str, control: Any, model: str, turns: int, lat: list[float]
) -> None:
    sid = (await control.post("/sessions", json={})).json()["session_id"]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Session {sid}: fix the failing test."},
    ]
    for turn in range(turns):
        started = time.perf_counter()
        r = await client.post(
            f"{gw}/v1/chat/completions",
            headers={"authorization": f"Bearer {sid}"},
            json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0},
        )
        lat.append(time.perf_counter() - started)
        r.raise_for_status()
        answer = r.json()["choices"][0]["message"].get("content") or ""
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"turn {turn} output:\n{TOOL_OUT}"},
        ]
    await control.delete(f"/sessions/{sid}")


async def workload(
    gw: str, control_url: str, token: str, model: str, args: argparse.Namespace
) -> list[float]:
    lat: list[float] = []
    limit = asyncio.Semaphore(args.concurrency)
    auth = {"authorization": f"Bearer {token}"}
    async with (
        httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client,
        httpx.AsyncClient(base_url=control_url, headers=auth, timeout=60) as control,
    ):

        async def one() -> None:
            async with limit:
                await session(client, gw, control, model, args.turns, lat)

        await asyncio.gather(*(one() for _ in range(args.sessions)))
    return lat


def run(
    name: str, urls: list[str], model: str, affinity: bool, args: argparse.Namespace, tmp: Path
) -> Result:
    token = new_token()
    config = GatewayConfig(
        backend_urls=tuple(urls),
        served_model=model,
        store_path=tmp / f"{name.replace(' ', '-').replace(',', '')}.db",
        control_token=token,
        backend=BackendOptions(timeout_s=600.0),
        backend_affinity=affinity,
    )
    app = create_app(config)
    before = [prefix_counters(u) for u in urls]
    with serve(app.data, also=[app.control]) as server:
        started = time.perf_counter()
        lat = asyncio.run(workload(server.url, server.urls[1], token, model, args))
        seconds = time.perf_counter() - started
    after = [prefix_counters(u) for u in urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return Result(name, len(lat), seconds, lat, hits, queries)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm", metavar="MODEL_DIR", help="start two real vLLM servers serving this folder")
    parser.add_argument(
        "--spread-cores",
        action="store_true",
        help="--vllm: bind server i's engine to core i (VLLM_CPU_OMP_THREADS_BIND) instead of vLLM's auto",
    )
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16, help="sessions running at once")
    parser.add_argument("--slots", type=int, default=4, help="fake: calls a server runs at once")
    parser.add_argument("--decode-ms", type=float, default=20.0, help="fake: time of a call's answer")
    parser.add_argument(
        "--uncached-us", type=float, default=100.0, help="fake: time per uncached prompt token"
    )
    parser.add_argument(
        "--cache-blocks", type=int, default=2048, help="fake: prefix cache size, 16-token blocks"
    )
    args = parser.parse_args()
    servers = vllm_servers(args) if args.vllm else fake_servers(args)
    with servers as (urls, model, reset), tempfile.TemporaryDirectory() as tmp:
        results = []
        for name, picked, affinity in (
            ("1 server", urls[:1], True),
            ("2 servers, affinity", urls, True),
            ("2 servers, no affinity", urls, False),
        ):
            reset()
            results.append(run(name, picked, model, affinity, args, Path(tmp)))
            print(f"{name}: done", file=sys.stderr)
    kind = (
        "vLLM (real)"
        if args.vllm
        else f"fake (model: {args.slots} slots, {args.uncached_us:g} us/uncached token)"
    )
    print(f"\n{args.sessions} sessions x {args.turns} turns, {args.concurrency} at once; servers: {kind}\n")
    print("| gateway over | calls/s | p50 ms | p99 ms | prefix-cache hit rate | seconds |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(r.row())


if __name__ == "__main__":
    main()
