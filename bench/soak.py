"""Soak: 10,000 sessions of 60k tokens through one gateway; its RSS must stay flat (issue 12, point 5).

The fake vLLM (tests/fakes, ~4 bytes of text per token) and one gateway process, started here with
`session_idle_s` short enough that idle eviction happens during the run. `--concurrency` workers each run
sessions one after another: create, a first call with a ~60k-token history (a shared 58k-token body plus
~2k tokens of the session's own tool results), a second call with the answer and one more tool result, then
close the session (three in four) or abandon it (one in four: only idle eviction can free it). Every
`--every` sessions it prints the gateway's RSS. Then it waits, idle, until the last sessions were evicted
and `--after-s` more (a minute), and gives a verdict: RETURNED when the RSS is back within 10 % of what the
gateway held idle before the burst (after 4 sessions that went idle: its code loaded; issue 30), PLATEAU when it is not but did not grow after the
warm-up (the first tenth of the sessions), GROWING when it grew (a leak).

    PYTHONPATH=src .venv/bin/python bench/soak.py                     # 10,000 sessions; about 15 minutes
    PYTHONPATH=src .venv/bin/python bench/soak.py --sessions 1000     # a quick look
    PYTHONPATH=src .venv/bin/python bench/soak.py --src ../main/src   # another checkout's gateway
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from gateway_context import SYSTEM, TOOLS, round_trip, rss_mib, start  # noqa: E402
from polar.serving import free_port  # noqa: E402


def serve(backend: str, port: int, cport: int, store: str, idle_s: float) -> None:
    """The gateway, in this process (`--serve`): built from a GatewayConfig so the soak can set the idle
    TTL; a checkout whose config has no such field runs with its defaults."""
    from polar.gateway.app import create_app
    from polar.gateway.config import GatewayConfig
    from polar.serving import EmbeddedServer, start_all

    extra: dict[str, Any] = {}
    if "session_idle_s" in {f.name for f in fields(GatewayConfig)}:
        extra["session_idle_s"] = idle_s
    config = GatewayConfig(
        backend_url=backend,
        served_model="m",
        store_path=Path(store),
        control_token=os.environ["POLAR_TOKEN"],
        port=port,
        control_port=cport,
        **extra,
    )
    app = create_app(config)

    async def run() -> None:
        servers = [
            EmbeddedServer(app.data, "127.0.0.1", port, log_level="warning"),
            EmbeddedServer(app.control, "127.0.0.1", cport, lifespan="off", log_level="warning"),
        ]
        await start_all(servers)
        print(f"soak gateway on {port}, control on {cport}, {extra or 'default settings'}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


def base_history(tokens: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Fix the failing test in tests/test_parser.py."},
    ]
    i = 0
    while len(orjson.dumps(msgs)) + 3000 < tokens * 4:
        msgs += round_trip("shared", i)
        i += 1
    return msgs


async def worker(
    client: httpx.AsyncClient,
    url: str,
    control: str,
    admin: dict[str, str],
    base: list[dict[str, Any]],
    todo: list[int],
    done: list[int],
) -> None:
    tools = [{"type": "function", "function": t} for t in TOOLS]
    while todo:
        n = todo.pop()
        r = await client.post(control + "/sessions", json={"task_id": "soak"}, headers=admin)
        r.raise_for_status()
        sid = r.json()["session_id"]
        tag = secrets.token_hex(4)
        msgs = [*base, *(m for i in range(8) for m in round_trip(tag, i))]
        auth = {"authorization": f"Bearer {sid}", "content-type": "application/json"}
        for call in range(2):
            body = orjson.dumps({"model": "m", "messages": msgs, "tools": tools, "max_tokens": 16})
            r = await client.post(url + "/v1/chat/completions", content=body, headers=auth)
            r.raise_for_status()
            answer = {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
            msgs = [*msgs, answer, round_trip(tag, 100 + call)[1]]
        if n % 4:
            (await client.delete(f"{control}/sessions/{sid}", headers=admin)).raise_for_status()
        done[0] += 1


async def drive(opts: argparse.Namespace, url: str, control: str, token: str, pid: int, db: Path) -> None:
    admin = {"authorization": f"Bearer {token}"}
    base = base_history(opts.tokens - 2000)
    todo = list(range(opts.sessions, 0, -1))
    done = [0]
    samples: list[tuple[int, float]] = []
    async with httpx.AsyncClient(timeout=300) as client:
        # The idle baseline: a gateway that has served a few sessions (its code paths loaded, its pools
        # and caches made) and let them go idle, as a node's gateway is between bursts.
        await worker(client, url, control, admin, base, list(range(4, 0, -1)), [0])
        await asyncio.sleep(opts.idle_s * 1.5 + 1)
        baseline = rss_mib(pid)
        print(f"idle baseline after 4 sessions: {baseline:.1f} MiB", flush=True)
        t0 = time.monotonic()
        print(f"{'sessions':>9} {'seconds':>8} {'RSS MiB':>8} {'store MiB':>10}", flush=True)
        tasks = [
            asyncio.create_task(worker(client, url, control, admin, base, todo, done))
            for _ in range(opts.concurrency)
        ]
        next_mark = 0
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.2)
            if done[0] >= next_mark or all(t.done() for t in tasks):
                rss = rss_mib(pid)
                samples.append((done[0], rss))
                size = sum(p.stat().st_size for p in db.parent.glob(db.name + "*")) / 2**20
                print(f"{done[0]:>9} {time.monotonic() - t0:>8.0f} {rss:>8.1f} {size:>10.0f}", flush=True)
                next_mark = done[0] + opts.every
        for t in tasks:
            t.result()
    # Idle: the abandoned sessions of the last stretch go idle after idle_s and the next sweep (every
    # idle_s / 2) evicts them; then `--after-s` more, the time the gateway has to give the memory back.
    idle_t0 = time.monotonic()
    wait = opts.idle_s * 1.5 + opts.after_s
    while time.monotonic() - idle_t0 < wait:
        await asyncio.sleep(min(10.0, wait - (time.monotonic() - idle_t0)))
        rss = rss_mib(pid)
        print(
            f"{done[0]:>9} {time.monotonic() - t0:>8.0f} {rss:>8.1f}   (idle {time.monotonic() - idle_t0:.0f} s)"
        )
    samples.append((done[0], rss))
    warm = next(s for s in samples if s[0] >= opts.sessions // 10)
    peak = max(r for n, r in samples if n >= warm[0])
    growth = rss - warm[1]
    # Three outcomes: the memory went back (within 10 % of the gateway's idle RSS before the burst);
    # it is held but bounded (a plateau: no growth after warm-up); or it grew (a leak).
    if rss <= 1.10 * baseline:
        verdict = "RETURNED"
    elif growth <= max(16.0, 0.1 * warm[1]):
        verdict = "PLATEAU (held, not growing)"
    else:
        verdict = "GROWING"
    print(
        f"\nverdict: {verdict}: RSS {baseline:.1f} MiB idle before the burst, {warm[1]:.1f} MiB after "
        f"{warm[0]} sessions, peak {peak:.1f} MiB, {rss:.1f} MiB after {wait:.0f} s idle "
        f"({100 * (rss / baseline - 1):+.0f} % of the baseline; {growth:+.1f} MiB over {done[0] - warm[0]} "
        f"sessions after warm-up, {1024 * growth / max(1, done[0] - warm[0]):+.2f} KiB per session)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=60_000, help="prompt tokens of a session's first call")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--every", type=int, default=500, help="print RSS every this many sessions")
    ap.add_argument("--idle-s", type=float, default=20.0, help="the gateway's session_idle_s")
    ap.add_argument(
        "--after-s",
        type=float,
        default=60.0,
        help="seconds idle after the sessions were evicted, before the verdict",
    )
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the checkout's src/ whose gateway runs")
    ap.add_argument("--serve", nargs=4, metavar=("BACKEND", "PORT", "CPORT", "STORE"), help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.serve:
        backend, port, cport, store = opts.serve
        serve(backend, int(port), int(cport), store, opts.idle_s)
        return

    tmp = Path(tempfile.mkdtemp(prefix="polar-soak-"))
    bport, port, cport = free_port(), free_port(), free_port()
    backend, url, control = (f"http://127.0.0.1:{p}" for p in (bport, port, cport))
    token = secrets.token_urlsafe(32)
    procs = [
        start(
            [sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport)],
            backend,
            pythonpath=str(ROOT),
        )
    ]
    try:
        db = tmp / "soak.db"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--idle-s", str(opts.idle_s)]
        cmd += ["--serve", backend, str(port), str(cport), str(db)]
        procs.append(start(cmd, url, {"POLAR_TOKEN": token}, pythonpath=f"{opts.src.resolve()}:{ROOT}"))
        asyncio.run(drive(opts, url, control, token, procs[-1].pid, db))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


if __name__ == "__main__":
    main()
