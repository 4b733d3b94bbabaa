"""Gateway overhead, side by side: the backend called directly, through `polar gateway`, through LiteLLM.

Processes on this machine: the fake vLLM (tests/fakes, a raw ASGI app far faster than what it serves),
`polar gateway` with capture on (every record committed to SQLite before the answer; started by
bench/soak.py's `--serve`: the shipped command with a short `session_idle_s`), LiteLLM's proxy in its own
venv with its closest capture (bench/litellm_proxy.py says what it records; left out with one line when it
cannot be installed), and `wrk` as the client (bench/wrk.py: C, a small fraction of the servers' CPU).
All three serve the same realistic bodies (7 kB: a 1.6 kB system prompt, six tools, a tool round trip;
~1,800 prompt tokens) for Chat (streamed and not) and Anthropic -> the backend's Chat route.

Servers are started once and warmed (1 s of load per path); then rounds: each (path, concurrency) cell is
run for each side in turn, the order rotating, and the table gives medians over rounds of calls/s, the
ratio to direct at the same concurrency and mode, the server process's CPU per call (/proc, its threads
and children), wrk's latency p50/p99 and wrk's own CPU per call. "direct" is wrk calling the fake itself
(its CPU column: the fake's). Memory: RSS at start, idle after 16 sessions (bench/soak.py's baseline), the
peak during a burst of soak's 60k-token sessions on polar and LiteLLM at once, and after each went idle
(its evictions plus `--after-s`). Last, the growing-session storage figure (`--storage-only`: just that).

    .venv/bin/python bench/gateway.py                 # ~15 minutes: 5 rounds of 4 s, a 1,000-session burst
    .venv/bin/python bench/gateway.py --quick         # ~5 minutes: 2 rounds of 2 s, 100 sessions
    .venv/bin/python bench/gateway.py --storage-only  # the store's growth per call of a growing session
    .venv/bin/python bench/gateway.py --no-litellm --burst 0 --paths chat responses gemini
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import litellm_proxy, wrk  # noqa: E402
from bench.processes import rss_mib, start, start_gateway  # noqa: E402
from bench.sides import (  # noqa: E402
    PATHS,
    Side,
    base,
    load_average,
    measure,
    memory_baseline,
    memory_burst,
    print_memory,
    print_table,
    rounds,
)

from polar.serving import free_port  # noqa: E402

SYSTEM = "You are a coding agent. " + "Follow the repository conventions and explain nothing. " * 30
TOOLS = [
    {
        "name": name,
        "description": f"{name}: " + "does a thing in the workspace with care. " * 6,
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "file path relative to the workspace"},
                "content": {"type": "string", "description": "text to write"},
                "timeout": {"type": "integer", "description": "seconds"},
            },
            "required": ["path"],
        },
    }
    for name in ("read_file", "write_file", "bash", "grep", "list_dir", "apply_patch")
]
USER = "Fix the failing test in tests/test_parser.py; the parser drops trailing commas. " * 4
TOOL_OUT = "collected 12 items\n\ntests/test_parser.py ....F.......\n" + "E   AssertionError: ...\n" * 10


def bodies(stream: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    """Equivalent realistic requests in each dialect: system prompt, tools, a tool round trip."""
    args = '{"path":"tests/test_parser.py"}'
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": args}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": TOOL_OUT},
        ],
        "tools": [{"type": "function", "function": t} for t in TOOLS],
        "max_tokens": 64,
        "stream": stream,
    }
    responses = {
        "model": "m",
        "instructions": SYSTEM,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]},
            {"type": "function_call", "call_id": "c1", "name": "bash", "arguments": args},
            {"type": "function_call_output", "call_id": "c1", "output": TOOL_OUT},
        ],
        "tools": [{"type": "function", **t} for t in TOOLS],
        "max_output_tokens": 64,
        "stream": stream,
        "store": False,
    }
    anthropic = {
        "model": "m",
        "max_tokens": 64,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": [
            {"role": "user", "content": USER},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "c1",
                        "name": "bash",
                        "input": {"path": "tests/test_parser.py"},
                    }
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": TOOL_OUT}]},
        ],
        "tools": [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
            for t in TOOLS
        ],
        "stream": stream,
    }
    gemini = {
        "systemInstruction": {"parts": [{"text": SYSTEM}]},
        "contents": [
            {"role": "user", "parts": [{"text": USER}]},
            {
                "role": "model",
                "parts": [
                    {"functionCall": {"id": "c1", "name": "bash", "args": {"path": "tests/test_parser.py"}}}
                ],
            },
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"id": "c1", "name": "bash", "response": {"output": TOOL_OUT}}}
                ],
            },
        ],
        "tools": [
            {
                "functionDeclarations": [
                    {
                        "name": t["name"],
                        "description": t["description"],
                        "parametersJsonSchema": t["parameters"],
                    }
                    for t in TOOLS
                ]
            }
        ],
        "generationConfig": {"maxOutputTokens": 64},
    }
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    return {
        "chat": ("/v1/chat/completions", chat),
        "responses": ("/v1/responses", responses),
        "anthropic": ("/v1/messages", anthropic),
        "gemini": (f"/v1beta/models/m:{method}", gemini),
    }


async def load(url: str, body: bytes, headers: dict[str, str], concurrency: int, calls: int) -> list[float]:
    latencies: list[float] = []
    remaining = calls
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                t = time.perf_counter()
                async with http.post(url, data=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: {r.status} {await r.text()}")
                latencies.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        latencies.append(-(time.perf_counter() - t0))  # total wall time, popped by the caller
    return latencies


def growing_session(gw: str, key: str, calls: int) -> tuple[int, int]:
    """A chat session whose history grows by a tool round trip each call; returns (calls, request bytes)."""
    import httpx

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
    ]
    sent = 0
    with httpx.Client(timeout=60) as client:
        for i in range(calls):
            body = {
                "model": "m",
                "messages": messages,
                "tools": [{"type": "function", "function": t} for t in TOOLS],
                "max_tokens": 32,
            }
            raw = orjson.dumps(body)
            sent += len(raw)
            r = client.post(
                gw + "/v1/chat/completions", content=raw, headers={"authorization": f"Bearer {key}"}
            )
            r.raise_for_status()
            msg = r.json()["choices"][0]["message"]
            messages = [
                *messages,
                {"role": "assistant", "content": msg["content"]},
                {"role": "user", "content": f"step {i}: " + TOOL_OUT},
            ]
    return calls, sent


def stopped_size(db: Path) -> int:
    """The store's bytes once its gateway stopped (its last connection checkpoints the WAL into the
    database and removes it; a WAL file keeps its high-water size, so reading sizes while the gateway runs
    would count reused WAL space as growth, and opening the store from here while it runs is not safe:
    see the report of issue 30 point 5)."""
    return sum(f.stat().st_size for f in db.parent.glob(db.name + "*"))


# ---- the run ----


def timed_start(make: Callable[[], subprocess.Popen[bytes]]) -> tuple[subprocess.Popen[bytes], float]:
    """A server started and answering its health check, and the seconds that took."""
    t = time.perf_counter()
    proc = make()
    return proc, time.perf_counter() - t


def start_sides(opts: argparse.Namespace, tmp: Path, procs: list[subprocess.Popen[bytes]]) -> list[Side]:
    bport, gport, cport, lport = free_port(), free_port(), free_port(), free_port()
    backend, gw, control = (f"http://127.0.0.1:{p}" for p in (bport, gport, cport))
    fake, _ = timed_start(
        lambda: start([sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport)], backend)
    )
    procs.append(fake)
    sides = [Side("direct", backend, fake.pid, "direct")]
    if opts.storage_only:
        return sides

    token = secrets.token_urlsafe(32)
    argv = [sys.executable, str(ROOT / "bench" / "soak.py"), "--idle-s", str(opts.idle_s)]
    argv += [f"--gateway-arg={a}" for a in opts.gateway_arg]
    argv += ["--serve", backend, str(gport), str(cport), str(tmp / "bench.db")]
    polar, took = timed_start(lambda: start(argv, gw, {"POLAR_TOKEN": token}, log=tmp / "polar.log"))
    procs.append(polar)
    admin = {"authorization": f"Bearer {token}"}
    key = httpx.post(control + "/sessions", json={"task_id": "bench"}, headers=admin).json()["session_id"]
    sides.append(Side("polar", gw, polar.pid, key, control, token))
    sides[-1].started_s, sides[-1].started_mib = took, rss_mib(polar.pid)

    exe = None if opts.no_litellm or opts.storage_only else litellm_proxy.install()
    if exe is not None:
        lkey = "sk-bench-" + secrets.token_hex(8)
        proxy, took = timed_start(lambda: litellm_proxy.serve(exe, backend, lport, lkey, tmp))
        procs.append(proxy)
        lside = Side("LiteLLM", f"http://127.0.0.1:{lport}", proxy.pid, lkey, capture=tmp / "litellm.jsonl")
        lside.started_s, lside.started_mib = took, rss_mib(proxy.pid)
        sides.append(lside)
    return sides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 s, a burst of 100 sessions")
    ap.add_argument("--storage-only", action="store_true", help="only the growing-session storage figure")
    ap.add_argument("--no-litellm", action="store_true", help="direct and polar only")
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), default=["chat", "chat-stream", "anthropic"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 5; --quick 2)")
    ap.add_argument("--seconds", type=float, help="wrk seconds per point (default 4; --quick 2)")
    ap.add_argument(
        "--burst", type=int, help="sessions in the memory burst (default 1000; --quick 100; 0: none)"
    )
    ap.add_argument(
        "--tokens", type=int, default=60_000, help="prompt tokens of a burst session's first call"
    )
    ap.add_argument("--idle-s", type=float, default=20.0, help="the gateway's session_idle_s (bench/soak.py)")
    ap.add_argument("--after-s", type=float, default=60.0, help="seconds idle after the burst's evictions")
    ap.add_argument("--gateway-arg", action="append", default=[], metavar="ARG", help="for `polar gateway`")
    ap.add_argument(
        "--keep", action="store_true", help="keep the stores, capture and logs (GBs after a full run)"
    )
    opts = ap.parse_args()
    opts.rounds = opts.rounds or (2 if opts.quick else 5)
    opts.seconds = opts.seconds or (2.0 if opts.quick else 4.0)
    opts.burst = (100 if opts.quick else 1000) if opts.burst is None else opts.burst
    # Each path is compared with the backend's own chat call in the same mode: measure those too.
    opts.paths = list(dict.fromkeys([base(p) for p in opts.paths] + opts.paths))
    wrk.find_wrk()

    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sides = start_sides(opts, tmp, procs)
        print(
            f"load before: {load_average()}; sides: {', '.join(s.name for s in sides)}"
            + (f"; files in {tmp}" if opts.keep else ""),
            flush=True,
        )
        if not opts.storage_only:
            for side in sides:  # warm-up: first-call imports, pools, caches
                for path in opts.paths:
                    measure(side, path, 16, 1.0, bodies)
                side.points.clear()
            measured = sides[1:]
            if opts.burst:
                asyncio.run(memory_baseline(measured, opts))
            rounds(sides, opts, bodies)
            print_table(sides, opts)
            time.sleep(1)  # LiteLLM writes its records after answering
            counts = ", ".join(
                f"{s.name} {s.records():,} records for {s.answered:,} answered calls" for s in measured
            )
            print(f"\ncapture on the measured key: {counts} (records >= calls: none lost)")
            if opts.burst:
                wait = asyncio.run(memory_burst(measured, opts))
                print_memory(measured, opts, wait)
            print(f"load after: {load_average()}")
        storage(sides[0].url, tmp)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        if not opts.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def storage(backend: str, tmp: Path) -> None:
    """A 200-call session whose history grows every call, on a gateway of its own: what its store grows by
    per call (the store's size after a stop with no call, then after a stop with the session's calls)."""
    db = tmp / "growth.db"
    sizes = []
    for calls in (0, 200):
        gateway = start_gateway(backend, db)
        try:
            if calls:
                sid = gateway.session("growth")["session_id"]
                _, sent = growing_session(gateway.url, sid, calls)
                url = f"{gateway.control}/sessions/{sid}/completions"
                recs = (
                    httpx.get(url, timeout=120, headers=gateway.admin)
                    .raise_for_status()
                    .json()["completions"]
                )
        finally:
            gateway.stop()
        sizes.append(stopped_size(db))
    prompt_ids = sum(len(r["prompt_ids"]) for r in recs)
    grew = sizes[1] - sizes[0]
    print(
        f"\ngrowing session: {calls} calls, last prompt {len(recs[-1]['prompt_ids'])} ids, "
        f"{sent / 2**20:.1f} MiB of requests and {prompt_ids * 4 / 2**20:.1f} MiB of prompt ids sent; "
        f"store grew {grew / 2**20:.2f} MiB = {grew / calls / 1024:.1f} KiB per call ({db.name})"
    )


if __name__ == "__main__":
    main()
