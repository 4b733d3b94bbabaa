"""Soak: bursts of 60k-token sessions through one gateway; is the memory given back once they went idle?
(issue 12 point 5, issue 30 point 4)

The fake vLLM (tests/fakes, ~4 bytes of text per token) and one gateway process (`polar gateway` as
shipped, see `serve`), started here with `session_idle_s` (`--idle-s`, 20 s) short enough that idle
eviction happens within the run. `--concurrency` workers each run sessions one after another: create, a
first call with a ~60k-token history (a shared 58k-token body plus ~2k tokens of the session's own tool
results), a second call with the answer and one more tool result, then close the session (three in four)
or abandon it (one in four: only idle eviction can free it).

The idle baseline is the RSS after a small burst (2 x concurrency sessions) went idle. Then each of
`--bursts` bursts of `--sessions` (4,000) runs, printing the RSS every `--every` sessions, and the bench
waits, reading the gateway's live sessions from its metrics, until none is live and `--after-s` (60 s)
more. The verdict (`verdict`) reads those idle-phase series: RELEASED (no session live, within 10 % of the
baseline), PLATEAU (sessions still live: what is held is theirs; a run shorter than the idle timeout),
LEAK (with no session live the RSS grew, while idle or from one burst to the next), HELD (above, none
live, not growing). The gateway reports where its memory is (bench/memstats.py) at the baseline, each
burst's peak and its end; POLAR_SOAK_TRACEMALLOC=1 adds what was allocated since the baseline and is still
live (slow: use a few hundred sessions), POLAR_SOAK_STRAYS=1 what lies in the memory mapped since it (the
objects that keep a burst's arenas). bench/gateway.py runs the same burst against LiteLLM too.

    PYTHONPATH=src .venv/bin/python bench/soak.py                       # 4,000 sessions; ~5 minutes
    PYTHONPATH=src .venv/bin/python bench/soak.py --bursts 2            # a leak shows as growth between them
    PYTHONPATH=src .venv/bin/python bench/soak.py --sessions 400 --idle-s 5 --after-s 15   # a quick look
    PYTHONPATH=src .venv/bin/python bench/soak.py --src ../base/src     # another checkout's gateway
    PYTHONPATH=src .venv/bin/python bench/soak.py --gateway-arg=--render --gateway-arg=gateway \
        --gateway-arg=--tokenizer --gateway-arg=DIR                      # the gateway rendering prompts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
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
    if os.environ.get("POLAR_SOAK_MEMSTATS"):
        import memstats

        memstats.install(os.environ["POLAR_SOAK_MEMSTATS"])
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
    client: httpx.AsyncClient,
    url: str,
    sessions: Sessions,
    base: list[dict[str, Any]],
    idle_s: float,
    concurrency: int = 8,
) -> None:
    """A server that has served a small burst (2 x `concurrency` sessions, `concurrency` at a time: its code
    paths loaded, those only concurrent calls reach too, such as batched commits) and let it go idle, as a
    node's gateway is between bursts: read its RSS after this."""
    todo = list(range(2 * concurrency, 0, -1))
    await asyncio.gather(*(worker(client, url, sessions, base, todo, [0]) for _ in range(concurrency)))
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
    """How long after a burst to read the RSS, for a server whose live sessions cannot be read: the abandoned
    sessions of its last stretch go idle after idle_s and the next sweep (every idle_s / 2) evicts them;
    then `after_s` more, the time the gateway has to give the memory back."""
    return idle_s * 1.5 + after_s


@dataclass(frozen=True)
class Sample:
    """One reading during a burst's idle phase: seconds since the burst ended, sessions the gateway holds
    (None where the server cannot say), RSS in MiB."""

    t: float
    live: int | None
    rss: float


@dataclass(frozen=True)
class Verdict:
    label: str  # RELEASED, PLATEAU, HELD or LEAK
    why: str

    def __str__(self) -> str:
        return f"{self.label}: {self.why}"


def verdict(baseline: float, bursts: list[list[Sample]], tolerance: float = 0.10) -> Verdict:
    """What the RSS did after the bursts, from each burst's idle-phase samples (the last one of each is read
    after the wait): LEAK when, with no session live, it grew (from one burst's end to the next's, or
    while idle) by more than `tolerance` of the baseline; RELEASED when the last is within `tolerance` of
    the baseline with no session live; PLATEAU when sessions are still live (the run ended before they
    went idle: what is held is theirs); HELD when it is above with none live but not growing."""
    ends = [b[-1] for b in bursts]
    last = ends[-1]
    slack = tolerance * baseline
    quiet = [s for s in bursts[-1] if s.live == 0]
    vs = f"{last.rss:.1f} MiB, {100 * (last.rss / baseline - 1):+.0f} % of the idle baseline {baseline:.1f}"
    if len(ends) > 1 and all(e.live == 0 for e in ends) and ends[-1].rss - ends[0].rss > slack:
        rise = " -> ".join(f"{e.rss:.1f}" for e in ends)
        return Verdict("LEAK", f"with no session live after each burst the RSS rose: {rise} MiB")
    if len(quiet) > 1 and quiet[-1].rss - min(s.rss for s in quiet) > slack:
        grew = quiet[-1].rss - min(s.rss for s in quiet)
        return Verdict("LEAK", f"it grew by {grew:.1f} MiB while no session was live ({vs})")
    if last.live in (0, None) and last.rss <= baseline + slack:
        unknown = " (the server cannot say how many sessions it holds)" if last.live is None else ""
        return Verdict("RELEASED", f"{vs}, no session live{unknown}")
    if last.live:
        each = 1024 * (last.rss - baseline) / last.live
        return Verdict(
            "PLATEAU",
            f"{last.live} sessions still live, held by them ({each:.0f} KiB each above the baseline; {vs}); "
            "wait past the idle timeout for the rest",
        )
    hint = (
        "from burst to burst"
        if len(ends) > 1
        else "in one burst (--bursts 2 tells a leak from a one-time hold)"
    )
    return Verdict("HELD", f"{vs} with no session live, not growing {hint}")


async def live_sessions(client: httpx.AsyncClient, control: str, token: str) -> int | None:
    """Sessions the gateway holds in memory, from its metrics (None if it does not say)."""
    r = await client.get(control + "/metrics", headers={"authorization": f"Bearer {token}"})
    m = (
        re.search(r"^polar_gateway_sessions_live ([0-9.e+]+)$", r.text, re.M)
        if r.status_code == 200
        else None
    )
    return None if m is None else int(float(m.group(1)))


def memstats_table(path: Path, labels: list[str]) -> str:
    """The gateway's own breakdown (bench/memstats.py) at each labelled moment, if it wrote one."""
    import memstats

    if not path.exists():
        return ""
    snaps = [json.loads(line) for line in path.read_text().splitlines()]
    return memstats.render(list(zip(labels, snaps, strict=False)))


async def drive(
    opts: argparse.Namespace, url: str, control: str, token: str, pid: int, db: Path, stats: Path
) -> None:
    sessions = GatewaySessions(control, token)
    base = base_history(opts.tokens - 2000)
    labels = ["idle"]
    bursts: list[list[Sample]] = []
    async with httpx.AsyncClient(timeout=300) as client:
        started = rss_mib(pid)
        await idle_baseline(client, url, sessions, base, opts.idle_s, opts.concurrency)
        baseline = rss_mib(pid)
        os.kill(pid, signal.SIGUSR1)
        print(
            f"RSS {started:.1f} MiB at start, idle baseline {baseline:.1f} MiB "
            f"(after {2 * opts.concurrency} sessions, {opts.concurrency} at a time, went idle)",
            flush=True,
        )
        for n in range(1, opts.bursts + 1):
            t0 = time.monotonic()
            print(f"burst {n}:\n{'sessions':>9} {'seconds':>8} {'RSS MiB':>8} {'store MiB':>10}", flush=True)
            next_mark = [0]
            peak = [0.0]

            def tick(
                done: int, t0: float = t0, next_mark: list[int] = next_mark, peak: list[float] = peak
            ) -> None:
                rss = rss_mib(pid)
                peak[0] = max(peak[0], rss)
                if done >= next_mark[0] or done == opts.sessions:
                    size = sum(p.stat().st_size for p in db.parent.glob(db.name + "*")) / 2**20
                    print(f"{done:>9} {time.monotonic() - t0:>8.0f} {rss:>8.1f} {size:>10.0f}", flush=True)
                    next_mark[0] = done + opts.every if done < opts.sessions else opts.sessions + 1

            await burst(client, url, sessions, base, opts.sessions, opts.concurrency, tick)
            os.kill(pid, signal.SIGUSR1)
            labels += [f"peak {n}", f"after {n}"]
            # Idle: until no session is live (the abandoned ones evicted), then `--after-s` more.
            idle_t0 = time.monotonic()
            samples: list[Sample] = []
            gone: float | None = None
            while True:
                await asyncio.sleep(5.0)
                now = time.monotonic() - idle_t0
                live = await live_sessions(client, control, token)
                samples.append(Sample(now, live, rss_mib(pid)))
                print(
                    f"{'':>9} {time.monotonic() - t0:>8.0f} {samples[-1].rss:>8.1f}   (idle {now:.0f} s, {live} live)"
                )
                if gone is None and (live == 0 or now >= idle_wait_s(opts.idle_s, 0) + 30):
                    gone = now  # the last session evicted (or the sweep is overdue: read what is there)
                if gone is not None and now - gone >= opts.after_s:
                    break
            os.kill(pid, signal.SIGUSR1)
            bursts.append(samples)
            last = samples[-1]
            print(
                f"burst {n}: peak {peak[0]:.1f} MiB; {last.rss:.1f} MiB {last.t:.0f} s after it ended "
                f"({opts.after_s:.0f} s after the last session went), {100 * (last.rss / baseline - 1):+.1f} %",
                flush=True,
            )
    await asyncio.sleep(1)
    table = memstats_table(stats, labels)
    if table:
        print("\n" + table)
    print(f"\nverdict: {verdict(baseline, bursts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4_000, help="sessions in a burst")
    ap.add_argument("--bursts", type=int, default=1, help="bursts, each followed by the idle wait")
    ap.add_argument("--tokens", type=int, default=60_000, help="prompt tokens of a session's first call")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--every", type=int, default=500, help="print RSS every this many sessions")
    ap.add_argument("--idle-s", type=float, default=20.0, help="the gateway's session_idle_s")
    ap.add_argument(
        "--after-s",
        type=float,
        default=60.0,
        help="seconds idle after the last session was evicted, before the RSS is read",
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
            [sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport), "--model", "m"],
            backend,
            pythonpath=str(ROOT),
        )
    ]
    try:
        db, stats = tmp / "soak.db", tmp / "memstats.jsonl"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--idle-s", str(opts.idle_s)]
        cmd += [f"--gateway-arg={a}" for a in opts.gateway_arg]
        cmd += ["--serve", backend, str(port), str(cport), str(db)]
        env = {"POLAR_TOKEN": token, "POLAR_SOAK_MEMSTATS": str(stats)}
        procs.append(start(cmd, url, env, pythonpath=f"{opts.src.resolve()}:{ROOT}"))
        asyncio.run(drive(opts, url, control, token, procs[-1].pid, db, stats))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
