"""How much of the gateway's CPU per call is its own work: `polar gateway` beside a pass-through on the same
libraries (bench/passthrough.py: uvicorn with httptools, aiohttp upstream, nothing parsed or
recorded), beside the least a Python relay can cost (bench/passthrough_raw.py: asyncio protocols with
httptools' parsers, no framework) and beside the backend called directly (issue 30 point 1).

    .venv/bin/python bench/gateway_floor.py                      # chat, concurrency 1 16 64, 5 rounds
    .venv/bin/python bench/gateway_floor.py --concurrency 16 --repeats 3 --calls 2000
    .venv/bin/python bench/gateway_floor.py --wrk --seconds 3   # wrk as the client (bench/gateway.py's)
    .venv/bin/python bench/gateway_floor.py --wrk --svg docs/gateway_floor.svg   # and the picture of it

One fake vLLM (tests/fakes), the two relays and one `polar gateway` (capture on, a fresh store) are
started once and warmed; then each round runs every (concurrency, side) cell with bench/gateway.py's chat
body (7 kB, 1,610 prompt tokens) from an aiohttp closed loop, the sides' order rotating from cell to cell.
"CPU ms/call" is the serving process's user + system time over the cell (for direct, the fake's own), from
/proc; the table gives medians over rounds. polar minus pass-through is what parsing, translating,
recording and committing cost; the pass-through is the floor on the gateway's libraries, the raw relay that of
any relay written in Python on asyncio, and "raw relay + commit" (its `--store`) that of any relay that
commits each call's bytes before answering, as the gateway's capture does. `--wrk`: wrk drives each cell for
`--seconds` instead (bench/wrk.py; its own CPU per call is a sixth of the aiohttp loop's).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import wrk  # noqa: E402
from bench.gateway import bodies, load  # noqa: E402
from bench.processes import cpu_seconds, rotation, start, start_gateway  # noqa: E402

from polar.serving import free_port  # noqa: E402

SIDES = ("direct", "raw relay", "raw relay + commit", "pass-through", "polar")
MIXES = {  # --mixes: one half of the pass-through's libraries at a time (passthrough_raw.py's options)
    "uvicorn + raw client": ["--server", "uvicorn"],
    "raw server + aiohttp": ["--client", "aiohttp"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--calls", type=int, default=3000, help="calls per cell (default 3000)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mixes", action="store_true", help="also the relays with one of uvicorn or aiohttp")
    ap.add_argument("--wrk", action="store_true", help="wrk as the client, each cell --seconds long")
    ap.add_argument("--seconds", type=float, default=3.0, help="with --wrk: seconds per cell (default 3)")
    ap.add_argument("--svg", type=Path, help="also draw calls/s against direct per concurrency (matplotlib)")
    args = ap.parse_args()
    sides = (*SIDES[:4], *(MIXES if args.mixes else ()), SIDES[4])

    tmp = Path(tempfile.mkdtemp(prefix="polar-floor-"))
    bport, pport, rport = free_port(), free_port(), free_port()
    backend, passthrough = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{pport}"
    relay = f"http://127.0.0.1:{rport}"
    py = sys.executable
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start([py, "-m", "tests.fakes.fake_vllm", "--port", str(bport)], backend))
        cmd = [py, str(ROOT / "bench" / "passthrough.py"), "--backend", backend, "--port", str(pport)]
        procs.append(start(cmd, passthrough))
        cmd = [py, str(ROOT / "bench" / "passthrough_raw.py"), "--backend", backend, "--port", str(rport)]
        procs.append(start(cmd, relay))
        cport = free_port()
        committing = f"http://127.0.0.1:{cport}"
        cmd = [py, str(ROOT / "bench" / "passthrough_raw.py"), "--backend", backend, "--port", str(cport)]
        procs.append(start([*cmd, "--store", str(tmp / "relay.db")], committing))
        mixes = {}
        for name, options in MIXES.items() if args.mixes else ():
            port = free_port()
            mixes[name] = f"http://127.0.0.1:{port}"
            cmd = [py, str(ROOT / "bench" / "passthrough_raw.py"), "--backend", backend, "--port", str(port)]
            procs.append(start([*cmd, *options], mixes[name]))
        gateway = start_gateway(backend, tmp / "floor.db")
        procs.append(gateway.proc)
        key = gateway.session("floor")["session_id"]
        path, body = bodies(False)["chat"]
        raw = orjson.dumps(body)
        plain = {"content-type": "application/json"}
        where = {
            "direct": (backend, plain, procs[0].pid),
            "raw relay": (relay, plain, procs[2].pid),
            "raw relay + commit": (committing, plain, procs[3].pid),
            "pass-through": (passthrough, plain, procs[1].pid),
            "polar": (gateway.url, {**plain, "authorization": f"Bearer {key}"}, gateway.proc.pid),
            **{name: (url, plain, procs[4 + i].pid) for i, (name, url) in enumerate(mixes.items())},
        }
        for url, headers, _ in where.values():  # warm-up: imports, pools, caches
            asyncio.run(load(url + path, raw, headers, 16, 500))

        cells: dict[tuple[str, int], list[dict[str, float]]] = {}
        for r in range(args.repeats):
            for c, side in rotation(args.concurrency, sides, r):
                url, headers, pid = where[side]
                before = cpu_seconds(pid)
                if args.wrk:
                    w = wrk.run(url + path, raw, headers, c, args.seconds)
                    used = cpu_seconds(pid) - before
                    cell = {"rps": w.rps, "cpu": used / w.calls * 1000, "p50": w.p50_ms, "p99": w.p99_ms}
                else:
                    lat = asyncio.run(load(url + path, raw, headers, c, args.calls))
                    used = cpu_seconds(pid) - before
                    wall = -lat.pop()
                    lat.sort()
                    cell = {
                        "rps": args.calls / wall,
                        "cpu": used / args.calls * 1000,
                        "p50": lat[len(lat) // 2] * 1000,
                        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
                    }
                cells.setdefault((side, c), []).append(cell)
            print(f"round {r + 1} of {args.repeats} done", flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)

    def med(side: str, c: int, key: str) -> float:
        return statistics.median(x[key] for x in cells[(side, c)])

    size = f"{args.seconds:g} s of wrk" if args.wrk else f"{args.calls} calls"
    print(f"\nchat, {size} a cell, medians of {args.repeats} rounds")
    print("| conc | side | calls/s | vs direct | CPU ms/call | p50 ms | p99 ms |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        for side in sides:
            ratio = "" if side == "direct" else f"{med(side, c, 'rps') / med('direct', c, 'rps'):.2f}x"
            print(
                f"| {c} | {side} | {med(side, c, 'rps'):.0f} | {ratio} | {med(side, c, 'cpu'):.3f} "
                f"| {med(side, c, 'p50'):.2f} | {med(side, c, 'p99'):.2f} |"
            )
        own = med("polar", c, "cpu") - med("pass-through", c, "cpu")
        print(f"| {c} | polar's own work | | | {own:.3f} | | |")
    if args.svg is not None:
        ratios = {
            side: [med(side, c, "rps") / med("direct", c, "rps") for c in args.concurrency]
            for side in sides
            if side != "direct"
        }
        draw(args.svg, args.concurrency, ratios, size)
        print(f"\nwrote {args.svg}")


def draw(path: Path, concurrency: list[int], ratios: dict[str, list[float]], size: str) -> None:
    """Grouped bars: each side's calls/s as a fraction of direct's, per concurrency, with issue 30's 0.5x.
    Text stays text and the file carries no date (as bench/reward_curve.py's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(ratios)
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "polar", "font.size": 9}):
        fig, ax = plt.subplots(figsize=(7.2, 3.8))
        for i, (side, ys) in enumerate(ratios.items()):
            xs = [k + (i - (len(ratios) - 1) / 2) * width for k in range(len(concurrency))]
            bars = ax.bar(xs, ys, width, label=side)
            ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=1)
        ax.axhline(0.5, color="#c0392b", linewidth=1, linestyle="--", label="issue 30: 0.5x")
        ax.set_xticks(range(len(concurrency)), [f"concurrency {c}" for c in concurrency])
        ax.set_ylabel("calls/s, fraction of direct")
        ax.set_ylim(0, 1.3)
        ax.set_title(f"Chat, 7 kB body: relays and polar against the backend called directly ({size} a cell)")
        ax.legend(fontsize=7, ncols=5, loc="upper left")
        ax.grid(axis="y", color="#e5e5e5")
        ax.set_axisbelow(True)
        fig.tight_layout()
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)


if __name__ == "__main__":
    main()
