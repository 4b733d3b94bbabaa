"""Gateway overhead: direct calls to a fast fake backend vs the same calls through the gateway.

Three processes on this machine: the fake vLLM (tests/fakes), `polar gateway` with capture on (SQLite, group
commit, durable before answer), and this load generator (aiohttp, closed loop). For each dialect, streaming
and not, at concurrency 1 and 64, it prints throughput, p50 and p99, and the p50 the gateway adds over a
direct call. It then replays a 200-call session whose history grows every turn and reports bytes stored per
call.

    .venv/bin/python bench/gateway.py            # full run (about two minutes)
    .venv/bin/python bench/gateway.py --quick    # fewer calls
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.processes import start  # noqa: E402

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


def measure(
    url: str, body: dict[str, Any], headers: dict[str, str], concurrency: int, calls: int
) -> dict[str, float]:
    raw = orjson.dumps(body)
    asyncio.run(load(url, raw, headers, concurrency, min(100, calls)))  # warm-up
    lat = asyncio.run(load(url, raw, headers, concurrency, calls))
    wall = -lat.pop()
    lat.sort()
    return {
        "rps": len(lat) / wall,
        "p50": statistics.median(lat) * 1000,
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
    }


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


def settled_size(db: Path) -> int:
    """The database's size with its WAL checkpointed into it (a WAL file keeps its high-water size, so
    file sizes alone would count reused WAL space as growth)."""
    import sqlite3

    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--storage-only", action="store_true", help="only the growing-session storage figure")
    opts = ap.parse_args()
    n1, n64 = (150, 1500) if opts.quick else (400, 4000)

    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-"))
    bport, gport, cport = free_port(), free_port(), free_port()
    backend = f"http://127.0.0.1:{bport}"
    gw = f"http://127.0.0.1:{gport}"
    control = f"http://127.0.0.1:{cport}"  # the gateway's control listener (sessions, records)
    token = secrets.token_urlsafe(32)
    admin = {"authorization": f"Bearer {token}"}
    procs = [
        start([sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport)], backend),
        start(
            [
                sys.executable,
                "-m",
                "polar",
                "gateway",
                "--backend",
                backend,
                "--model",
                "m",
                "--port",
                str(gport),
                "--control-port",
                str(cport),
                "--store",
                str(tmp / "bench.db"),
                "--log-level",
                "warning",
            ],
            gw,
            env={"POLAR_TOKEN": token},
        ),
    ]
    try:
        import httpx

        key = httpx.post(control + "/sessions", json={"task_id": "bench"}, headers=admin).json()["session_id"]
        auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        rows: list[tuple[str, str, int, dict[str, float]]] = []
        direct: dict[tuple[bool, int], dict[str, float]] = {}
        for stream in () if opts.storage_only else (False, True):
            for c, n in ((1, n1), (64, n64)):
                chat_body = bodies(False)["chat"][1]  # the backend is always called without streaming
                direct[(stream, c)] = measure(backend + "/v1/chat/completions", chat_body, auth, c, n)
                rows.append(("direct (fake vLLM)", "-", c, direct[(stream, c)]))
                for dialect, (path, body) in bodies(stream).items():
                    rows.append(
                        (dialect, "stream" if stream else "json", c, measure(gw + path, body, auth, c, n))
                    )
        print()
        print(
            f"{'path':<20} {'mode':<7} {'conc':>4} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8}"
        )
        for name, mode, c, m in rows:
            base = direct[(mode == "stream", c)]
            added = "" if name.startswith("direct") else f"{m['p50'] - base['p50']:+.2f}"
            print(
                f"{name:<20} {mode:<7} {c:>4} {m['rps']:>9.0f} {m['p50']:>8.2f} {m['p99']:>8.2f} {added:>8}"
            )

        key2 = httpx.post(control + "/sessions", json={"task_id": "growth"}, headers=admin).json()[
            "session_id"
        ]
        db = tmp / "bench.db"
        before = settled_size(db)
        calls, sent = growing_session(gw, key2, 200)
        recs = httpx.get(f"{control}/sessions/{key2}/completions", timeout=120, headers=admin).json()[
            "completions"
        ]
        prompt_ids = sum(len(r["prompt_ids"]) for r in recs)
        after = settled_size(db)
        print()
        print(
            f"growing session: {calls} calls, last prompt {len(recs[-1]['prompt_ids'])} ids, "
            f"{sent / 2**20:.1f} MiB of requests and {prompt_ids * 4 / 2**20:.1f} MiB of prompt ids sent; "
            f"store grew {(after - before) / 2**20:.2f} MiB = {(after - before) / calls / 1024:.1f} KiB per call "
            f"({db.name})"
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


if __name__ == "__main__":
    main()
