"""Soak: 10,000 sessions of 60k tokens through one gateway; its RSS must stay flat (issue 12, point 5).

The fake vLLM (tests/fakes, ~4 bytes of text per token) and one gateway process (`polar gateway` as
shipped, see `serve`), started here with `session_idle_s` short enough that idle eviction happens during the
run. `--concurrency` workers each run sessions one after another: create, a first call with a ~60k-token
history (a shared 58k-token body plus ~2k tokens of the session's own tool results), a second call with the
answer and one more tool result, then close the session (three in four) or abandon it (one in four: only
idle eviction can free it). Every `--every` sessions it prints the gateway's RSS. Then it waits, idle,
until the last sessions were evicted and `--after-s` more (a minute), and gives a verdict: RETURNED when the
RSS is back within 10 % of what the gateway held idle before the burst (after 4 sessions that went idle: its
code loaded; issue 30), PLATEAU when it is not but did not grow after the warm-up (the first tenth of the
sessions), GROWING when it grew (a leak). bench/gateway.py runs the same burst against LiteLLM too.

    PYTHONPATH=src .venv/bin/python bench/soak.py                     # 10,000 sessions; about 15 minutes
    PYTHONPATH=src .venv/bin/python bench/soak.py --sessions 1000     # a quick look
    PYTHONPATH=src .venv/bin/python bench/soak.py --src ../main/src   # another checkout's gateway
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from gateway_context import SYSTEM, TOOLS, round_trip, rss_mib, start  # noqa: E402
from polar.serving import free_port  # noqa: E402


def serve(backend: str, port: int, cport: int, store: str, idle_s: float, extra: list[str]) -> None:
    """The gateway, in this process (`--serve`): the `polar gateway` command as shipped (its server options,
    its garbage-collector tuning), with one setting it has no flag for, `session_idle_s`, put into the
    config it builds so idle eviction happens within a run. A checkout whose config has no such field runs
    with its defaults."""
    from dataclasses import replace

    import polar.cli.gateway as cli
    from polar.gateway.config import GatewayConfig

    build = cli.build_gateway_config
    has_ttl = "session_idle_s" in {f.name for f in fields(GatewayConfig)}

    def with_ttl(**kwargs: Any) -> GatewayConfig:
        config = build(**kwargs)
        return replace(config, session_idle_s=idle_s) if has_ttl else config

    cli.build_gateway_config = with_ttl  # type: ignore[assignment]
    print(f"soak gateway on {port}, control on {cport}, session_idle_s {idle_s if has_ttl else 'default'}")
    argv = ["--backend", backend, "--model", "m", "--port", str(port), "--control-port", str(cport)]
    argv += ["--store", store, "--log-level", "warning", *extra]
    cli.gateway.main(argv, prog_name="polar gateway")


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


class Sessions(Protocol):
    """How a burst gets a key for each session and ends it: the gateway's control API, or (for a proxy
    without sessions, bench/gateway.py's LiteLLM) one fixed key and nothing to close."""

    async def open(self, client: httpx.AsyncClient) -> str: ...

    async def close(self, client: httpx.AsyncClient, key: str) -> None: ...


@dataclass
class GatewaySessions:
    control: str
    token: str

    async def open(self, client: httpx.AsyncClient) -> str:
        admin = {"authorization": f"Bearer {self.token}"}
        r = await client.post(self.control + "/sessions", json={"task_id": "soak"}, headers=admin)
        r.raise_for_status()
        return str(r.json()["session_id"])

    async def close(self, client: httpx.AsyncClient, key: str) -> None:
        admin = {"authorization": f"Bearer {self.token}"}
        (await client.delete(f"{self.control}/sessions/{key}", headers=admin)).raise_for_status()


async def worker(
    client: httpx.AsyncClient,
    url: str,
    sessions: Sessions,
    base: list[dict[str, Any]],
    todo: list[int],
    done: list[int],
) -> None:
    tools = [{"type": "function", "function": t} for t in TOOLS]
    while todo:
        n = todo.pop()
        key = await sessions.open(client)
        tag = secrets.token_hex(4)
        msgs = [*base, *(m for i in range(8) for m in round_trip(tag, i))]
        auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        for call in range(2):
            body = orjson.dumps({"model": "m", "messages": msgs, "tools": tools, "max_tokens": 16})
            r = await client.post(url + "/v1/chat/completions", content=body, headers=auth)
            r.raise_for_status()
            answer = {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
            msgs = [*msgs, answer, round_trip(tag, 100 + call)[1]]
        if n % 4:
            await sessions.close(client, key)
        done[0] += 1


async def idle_baseline(
    client: httpx.AsyncClient, url: str, sessions: Sessions, base: list[dict[str, Any]], idle_s: float
) -> None:
    """A server that has served a few sessions (its code paths loaded, its pools and caches made) and let
    them go idle, as a node's gateway is between bursts: read its RSS after this."""
    await worker(client, url, sessions, base, list(range(4, 0, -1)), [0])
    await asyncio.sleep(idle_s * 1.5 + 1)


async def burst(
    client: httpx.AsyncClient,
    url: str,
    sessions: Sessions,
    base: list[dict[str, Any]],
    count: int,
    concurrency: int,
    tick: Callable[[int], None],
) -> None:
    """`count` sessions, `concurrency` at a time; `tick(sessions done)` about every 0.2 s and at the end."""
    todo = list(range(count, 0, -1))
    done = [0]
    tasks = [asyncio.create_task(worker(client, url, sessions, base, todo, done)) for _ in range(concurrency)]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(0.2)
        tick(done[0])
    for t in tasks:
        t.result()


def idle_wait_s(idle_s: float, after_s: float) -> float:
    """How long after a burst to read the RSS: the abandoned sessions of its last stretch go idle after
    idle_s and the next sweep (every idle_s / 2) evicts them; then `after_s` more, the time the gateway has
    to give the memory back."""
    return idle_s * 1.5 + after_s


def verdict(baseline: float, warm: float, rss: float) -> str:
    """RETURNED: within 10 % of the idle RSS before the burst; PLATEAU: held but not grown after the
    warm-up (the RSS at `warm`); GROWING: it grew (a leak)."""
    if rss <= 1.10 * baseline:
        return "RETURNED"
    if rss - warm <= max(16.0, 0.1 * warm):
        return "PLATEAU (held, not growing)"
    return "GROWING"


async def drive(opts: argparse.Namespace, url: str, control: str, token: str, pid: int, db: Path) -> None:
    sessions = GatewaySessions(control, token)
    base = base_history(opts.tokens - 2000)
    samples: list[tuple[int, float]] = []
    async with httpx.AsyncClient(timeout=300) as client:
        await idle_baseline(client, url, sessions, base, opts.idle_s)
        baseline = rss_mib(pid)
        print(f"idle baseline after 4 sessions: {baseline:.1f} MiB", flush=True)
        t0 = time.monotonic()
        print(f"{'sessions':>9} {'seconds':>8} {'RSS MiB':>8} {'store MiB':>10}", flush=True)
        next_mark = [0]

        def tick(done: int) -> None:
            if done >= next_mark[0] or done == opts.sessions:
                rss = rss_mib(pid)
                samples.append((done, rss))
                size = sum(p.stat().st_size for p in db.parent.glob(db.name + "*")) / 2**20
                print(f"{done:>9} {time.monotonic() - t0:>8.0f} {rss:>8.1f} {size:>10.0f}", flush=True)
                next_mark[0] = done + opts.every if done < opts.sessions else opts.sessions + 1

        await burst(client, url, sessions, base, opts.sessions, opts.concurrency, tick)
    idle_t0 = time.monotonic()
    wait = idle_wait_s(opts.idle_s, opts.after_s)
    while time.monotonic() - idle_t0 < wait:
        await asyncio.sleep(min(10.0, wait - (time.monotonic() - idle_t0)))
        rss = rss_mib(pid)
        print(
            f"{opts.sessions:>9} {time.monotonic() - t0:>8.0f} {rss:>8.1f}   (idle {time.monotonic() - idle_t0:.0f} s)"
        )
    samples.append((opts.sessions, rss))
    warm = next(s for s in samples if s[0] >= opts.sessions // 10)
    peak = max(r for n, r in samples if n >= warm[0])
    growth = rss - warm[1]
    print(
        f"\nverdict: {verdict(baseline, warm[1], rss)}: RSS {baseline:.1f} MiB idle before the burst, "
        f"{warm[1]:.1f} MiB after {warm[0]} sessions, peak {peak:.1f} MiB, {rss:.1f} MiB after {wait:.0f} s "
        f"idle ({100 * (rss / baseline - 1):+.0f} % of the baseline; {growth:+.1f} MiB over "
        f"{opts.sessions - warm[0]} sessions after warm-up, "
        f"{1024 * growth / max(1, opts.sessions - warm[0]):+.2f} KiB per session)"
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
    ap.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for `polar gateway` (repeat it; e.g. --gateway-arg=--durability --gateway-arg=full)",
    )
    ap.add_argument("--serve", nargs=4, metavar=("BACKEND", "PORT", "CPORT", "STORE"), help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.serve:
        backend, port, cport, store = opts.serve
        serve(backend, int(port), int(cport), store, opts.idle_s, opts.gateway_arg)
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
        cmd += [f"--gateway-arg={a}" for a in opts.gateway_arg]
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
