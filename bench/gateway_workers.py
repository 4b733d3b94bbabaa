"""`polar gateway --workers N` side by side: direct, 1 worker, N workers (own base URLs), N workers on the
shared port, with wrk, interleaved, medians.

    .venv/bin/python bench/gateway_workers.py                          # 1 vs 2 workers, ~8 minutes
    .venv/bin/python bench/gateway_workers.py --workers 4 --rounds 3 --seconds 3 --paths chat

Processes: the fake vLLM (tests/fakes), one `polar gateway` per side with capture on (each its own store),
and `wrk` (bench/wrk.py). A worker count's calls go as a node's harnesses send them: sessions created on the
control listener, each called at the `base_url` it was given (its worker's own model API), the connections
spread evenly over the workers (one wrk per worker, one session each, `c / N` connections; at concurrency 1
only the first worker is called). "shared port" sends every call of one session to the gateway's shared
port instead, as a client that ignores `base_url` does: the calls that land on the other worker are passed
on to the owner (`polar.gateway.forward`). Each (path, concurrency) cell runs every side in turn, the order
rotating; the table gives medians over rounds: calls/s (summed over the wrk processes), the ratio to direct
and to 1 worker, CPU per call of the whole gateway (supervisor and workers, /proc), p50 (the wrk processes'
mean, weighted by calls) and p99 (the worst of them). Then the stored records are counted against the
answered calls, per side.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import wrk  # noqa: E402
from bench.gateway import bodies  # noqa: E402
from bench.processes import cpu_seconds, rotation, start, start_gateway  # noqa: E402
from bench.sides import PATHS, base, load_average  # noqa: E402

from polar.serving import free_port  # noqa: E402


@dataclass
class Side:
    name: str
    pid: int
    targets: list[tuple[str, str]]  # (base URL, session key), one per worker called
    control: str = ""
    token: str = ""
    points: dict[tuple[str, int], list[dict[str, float]]] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=dict)


def headers(path: str, key: str) -> dict[str, str]:
    if PATHS[path][0] == "anthropic":
        return {"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"}
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


def measure(side: Side, path: str, c: int, seconds: float) -> None:
    if side.name == "direct" and path != base(path):
        return
    dialect, stream = PATHS[path]
    route, body = bodies(stream)[dialect]
    raw = orjson.dumps(body)
    targets = side.targets[: max(1, min(c, len(side.targets)))]
    conns = [c // len(targets) + (1 if i < c % len(targets) else 0) for i in range(len(targets))]
    before = cpu_seconds(side.pid)
    with ThreadPoolExecutor(len(targets)) as pool:
        loads = list(
            pool.map(
                lambda t: wrk.run(t[0][0] + route, raw, headers(path, t[0][1]), t[1], seconds),
                zip(targets, conns, strict=True),
            )
        )
    used = cpu_seconds(side.pid) - before
    calls = sum(x.calls for x in loads)
    for (_, key), x in zip(targets, loads, strict=True):
        side.answered[key] = side.answered.get(key, 0) + x.calls
    errors = sum(x.errors for x in loads)
    if errors:
        print(f"  {side.name} {path} c={c}: {errors} errors", flush=True)
    side.points.setdefault((path, c), []).append(
        {
            "rps": sum(x.rps for x in loads),
            "cpu_ms": used / max(1, calls) * 1000,
            "p50": sum(x.p50_ms * x.calls for x in loads) / max(1, calls),
            "p99": max(x.p99_ms for x in loads),
            "errors": errors,
        }
    )


def start_side(
    name: str, workers: int, backend: str, tmp: Path, procs: list[subprocess.Popen[bytes]], shared: bool
) -> Side:
    gateway = start_gateway(
        backend, tmp / f"{workers}-{shared}.db", "--workers", str(workers), log=tmp / f"{name}.log"
    )
    procs.append(gateway.proc)
    by_worker: dict[str, str] = {}
    while len(by_worker) < (1 if shared else workers):  # one session on each worker
        made = gateway.session()
        by_worker.setdefault(made.get("base_url", gateway.url), made["session_id"])
    targets = [(gateway.url, key) for key in by_worker.values()] if shared else sorted(by_worker.items())
    return Side(name, gateway.proc.pid, targets, gateway.control, gateway.token)


def store_figures(side: Side) -> str:
    """From the gateway's /metrics (summed over workers): the mean time a call waited for its record's
    commit, and records per transaction (group commit), over the whole run."""
    text = httpx.get(f"{side.control}/metrics", headers={"authorization": f"Bearer {side.token}"}).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (
            "polar_gateway_record_commit_seconds_sum",
            "polar_gateway_record_commit_seconds_count",
            "polar_gateway_store_writes_total",
            "polar_gateway_store_commits_total",
        ):
            values[name] = float(value)
    wait = (
        values["polar_gateway_record_commit_seconds_sum"]
        / values["polar_gateway_record_commit_seconds_count"]
    )
    per = values["polar_gateway_store_writes_total"] / values["polar_gateway_store_commits_total"]
    return f"{side.name}: mean commit wait {wait * 1000:.2f} ms, {per:.1f} records per transaction"


def stored(side: Side) -> int:
    admin = {"authorization": f"Bearer {side.token}"}
    return sum(
        int(httpx.get(f"{side.control}/sessions/{key}", headers=admin).json()["completions"])
        for key in side.answered
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="the worker count compared with 1 (default 2)")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=["chat", "chat-stream", "anthropic"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--no-shared", action="store_true", help="leave out the shared-port side")
    opts = ap.parse_args()
    opts.paths = list(dict.fromkeys([base(p) for p in opts.paths] + opts.paths))
    wrk.find_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-workers-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        bport = free_port()
        backend = f"http://127.0.0.1:{bport}"
        fake = start([sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport)], backend)
        procs.append(fake)
        sides = [Side("direct", fake.pid, [(backend, "direct")])]
        sides.append(start_side("1 worker", 1, backend, tmp, procs, shared=False))
        n = opts.workers
        sides.append(start_side(f"{n} workers", n, backend, tmp, procs, shared=False))
        if not opts.no_shared:
            sides.append(start_side(f"{n} workers, shared port", n, backend, tmp, procs, shared=True))
        print(f"load before: {load_average()}; sides: {', '.join(s.name for s in sides)}", flush=True)
        for side in sides:  # warm-up: first-call imports, pools, caches
            for path in opts.paths:
                measure(side, path, 16, 1.0)
            side.points.clear()
        cells = [(p, c) for p in opts.paths for c in opts.concurrency]
        for r in range(opts.rounds):
            t = time.monotonic()
            for (path, c), side in rotation(cells, sides, r):
                measure(side, path, c, opts.seconds)
            print(
                f"round {r + 1}/{opts.rounds}: {time.monotonic() - t:.0f} s, load {load_average()}",
                flush=True,
            )
        table(sides, opts)
        time.sleep(0.5)
        print("\nstore, whole run: " + "; ".join(store_figures(s) for s in sides[1:]))
        print(
            "\ncapture: "
            + "; ".join(
                f"{s.name} {stored(s):,} records for {sum(s.answered.values()):,} answered" for s in sides[1:]
            )
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def table(sides: list[Side], opts: argparse.Namespace) -> None:
    direct, one = sides[0], sides[1]

    def med(side: Side, path: str, c: int, key: str) -> float:
        return statistics.median(m[key] for m in side.points[(path, c)])

    print(f"\n{opts.seconds:g} s of wrk per point, medians of {opts.rounds} interleaved rounds")
    print("| path | conc | side | calls/s | vs direct | vs 1 worker | CPU ms/call | p50 ms | p99 ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for path in opts.paths:
        for c in opts.concurrency:
            for side in sides:
                if (path, c) not in side.points:
                    continue
                rps = med(side, path, c, "rps")
                vs_direct = "" if side is direct else f"{rps / med(direct, base(path), c, 'rps'):.2f}x"
                vs_one = "" if side in (direct, one) else f"{rps / med(one, path, c, 'rps'):.2f}x"
                print(
                    f"| {path} | {c} | {side.name} | {rps:.0f} | {vs_direct} | {vs_one} | "
                    f"{med(side, path, c, 'cpu_ms'):.3f} | {med(side, path, c, 'p50'):.2f} | "
                    f"{med(side, path, c, 'p99'):.2f} |"
                )


if __name__ == "__main__":
    main()
