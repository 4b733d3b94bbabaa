"""The gateway's CPU per call and tail latency, this checkout against an earlier commit, interleaved.

    .venv/bin/python bench/gateway_cpu.py --ref HEAD~1                 # chat, concurrency 16, 5 rounds
    .venv/bin/python bench/gateway_cpu.py --ref v0.3 --concurrency 1 16 64 --repeats 3
    .venv/bin/python bench/gateway_cpu.py --ref HEAD~1 --path chat-stream  # streamed, to the last chunk

Each round starts, for each side, a fresh fake vLLM (tests/fakes) and a fresh `polar gateway` with capture
on (the earlier commit's from a temporary `git worktree`), warms it with 300 calls, then sends `--calls`
calls of bench/gateway.py's `--path` body (7 kB: a system prompt, six tools, a tool round trip) from an aiohttp
closed loop at each concurrency, and reads the gateway process's CPU time from /proc before and after.
Sides alternate within a round, so a busy moment of this shared machine hits both; the table gives medians
over rounds. "direct" is the same client calling the fake backend itself: the issue's limit (calls/s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import bodies, load  # noqa: E402
from bench.processes import cpu_seconds, start, start_gateway  # noqa: E402

from polar.serving import free_port  # noqa: E402


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """`ref` checked out in a temporary worktree (removed after); the current checkout is not touched."""
    where = Path(tempfile.mkdtemp(prefix="polar-bench-ref-"))
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(where), ref], cwd=ROOT, check=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, check=False)


def one(src: Path, concurrency: list[int], calls: int, which: str = "chat") -> dict[int, dict[str, float]]:
    """A fresh fake backend and gateway (polar from `src`), measured at each concurrency."""
    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-"))
    bport = free_port()
    backend = f"http://127.0.0.1:{bport}"
    fake = start([sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport)], backend)
    gateway = start_gateway(backend, tmp / "bench.db", pythonpath=f"{ROOT}:{src}")
    gw = gateway.url
    out: dict[int, dict[str, float]] = {}
    try:
        key = gateway.session("cpu")["session_id"]
        auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        stream = which.endswith("-stream")
        path, body = bodies(stream)[which.removesuffix("-stream")]
        raw = orjson.dumps(body)
        direct_path, direct_body = bodies(stream)["chat"]  # the backend serves Chat: the limit
        direct_raw = orjson.dumps(direct_body)
        asyncio.run(load(gw + path, raw, auth, 16, 300))  # warm-up: caches, first-call imports
        for c in concurrency:
            before = cpu_seconds(gateway.proc.pid)
            lat = asyncio.run(load(gw + path, raw, auth, c, calls))
            used = cpu_seconds(gateway.proc.pid) - before
            wall = -lat.pop()
            lat.sort()
            direct = asyncio.run(load(backend + direct_path, direct_raw, auth, c, calls))
            direct_wall = -direct.pop()
            out[c] = {
                "cpu_ms": used / calls * 1000,
                "rps": calls / wall,
                "p50": lat[len(lat) // 2] * 1000,
                "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
                "direct_rps": calls / direct_wall,
            }
    finally:
        for proc in (gateway.proc, fake):
            proc.terminate()
        for proc in (gateway.proc, fake):
            proc.wait(10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="HEAD", help="The earlier commit to compare with (default HEAD).")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--path",
        default="chat",
        choices=["chat", "chat-stream", "anthropic", "anthropic-stream"],
        help="The route and mode called (a stream is timed to its last chunk); direct is always Chat.",
    )
    args = ap.parse_args()

    runs: dict[str, list[dict[int, dict[str, float]]]] = {args.ref: [], "this checkout": []}
    with worktree(args.ref) as old:
        for r in range(args.repeats):
            for side, src in ((args.ref, old / "src"), ("this checkout", ROOT / "src")):
                runs[side].append(one(src, args.concurrency, args.calls, args.path))
                m = runs[side][-1]
                print(
                    f"round {r + 1} {side}: " + ", ".join(f"c={c} {m[c]['cpu_ms']:.3f} ms" for c in m),
                    flush=True,
                )
            time.sleep(1)
    print(f"\n{args.path}, {args.calls} calls per point, medians of {args.repeats} interleaved rounds")
    print("| side | concurrency | CPU ms/call | calls/s | vs direct | p50 ms | p99 ms | p99/p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        for side, rounds in runs.items():

            def med(key: str, rounds: list[dict[int, dict[str, float]]] = rounds, c: int = c) -> float:
                return statistics.median(x[c][key] for x in rounds)

            print(
                f"| {side} | {c} | {med('cpu_ms'):.3f} | {med('rps'):.0f} | {med('rps') / med('direct_rps'):.2f}x "
                f"| {med('p50'):.1f} | {med('p99'):.1f} | {med('p99') / med('p50'):.1f} |"
            )


if __name__ == "__main__":
    main()
