"""Streaming through the gateway: time to first token and tokens/s, gateway vs direct to the backend.

Each streamed call is timed from sending the request to the first text delta (TTFT) and from there to the
last one (tokens/s over the text deltas after the first), by a client that reads the SSE events as they
arrive. "direct" is the same client streaming from the backend itself with the body the gateway sends
upstream (`stream`, `stream_options.include_usage`, `return_token_ids`, `logprobs`); each dialect is the
same call through `polar gateway` (capture on: SQLite, the record committed before the closing event).
Calls run one at a time, the targets in turn, so the table compares medians taken side by side.

    .venv/bin/python bench/streaming.py                          # against the fake vLLM (tests/fakes)
    .venv/bin/python bench/streaming.py --token-delay-ms 5       # a backend that samples 200 tokens/s
    .venv/bin/python bench/streaming.py --vllm http://127.0.0.1:8000   # a running real vLLM (any model)

`--vllm URL` points at a vLLM that is already serving (started as docs/backends.md says, e.g. by
`tests/vllm_support.start_vllm` once that lands on main); the fake is then not started.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.processes import start  # noqa: E402

from polar.serving import free_port  # noqa: E402

PROMPT = "Write a long paragraph about foxes and dogs."
DIALECTS = ("chat", "responses", "anthropic", "gemini")


def requests(model: str, max_tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """The same streamed call in each dialect: (path, body)."""
    user = [{"role": "user", "content": PROMPT}]
    return {
        "chat": (
            "/v1/chat/completions",
            {"model": model, "messages": user, "stream": True, "max_tokens": max_tokens, "temperature": 0},
        ),
        "responses": (
            "/v1/responses",
            {
                "model": model,
                "input": PROMPT,
                "stream": True,
                "max_output_tokens": max_tokens,
                "temperature": 0,
            },
        ),
        "anthropic": (
            "/v1/messages",
            {"model": model, "messages": user, "stream": True, "max_tokens": max_tokens, "temperature": 0},
        ),
        "gemini": (
            f"/v1beta/models/{model}:streamGenerateContent?alt=sse",
            {
                "contents": [{"role": "user", "parts": [{"text": PROMPT}]}],
                "generationConfig": {"maxOutputTokens": max_tokens, "temperature": 0},
            },
        ),
    }


def text_of(target: str, data: bytes) -> bool:
    """Whether an SSE data payload carries answer text (what a user would see appear)."""
    if data == b"[DONE]":
        return False
    d = orjson.loads(data)
    if target in ("direct", "chat"):
        choices = d.get("choices") or []
        return bool(choices and (choices[0].get("delta") or {}).get("content"))
    if target == "responses":
        return d.get("type") == "response.output_text.delta"
    if target == "anthropic":
        return d.get("type") == "content_block_delta" and d["delta"].get("type") == "text_delta"
    parts = (d.get("candidates") or [{}])[0].get("content", {}).get("parts") or []
    return any(p.get("text") and not p.get("thought") for p in parts)


async def one_call(
    http: aiohttp.ClientSession, target: str, url: str, body: bytes, headers: dict[str, str]
) -> tuple[float, float, int]:
    """(TTFT ms, tokens/s after the first, text deltas) of one streamed call."""
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    buf = b""
    async with http.post(url, data=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{target}: HTTP {r.status}: {(await r.read())[:300]!r}")
        async for piece in r.content.iter_any():
            now = time.perf_counter()
            frames = (buf + piece).split(b"\n\n")
            buf = frames.pop()
            for frame in frames:
                for line in frame.split(b"\n"):
                    if line.startswith(b"data: ") and text_of(target, line[6:]):
                        n += 1
                        if n == 1:
                            first = now
                        last = now
    if n < 2:
        raise RuntimeError(f"{target}: {n} text deltas; the answer is too short to time")
    # Every delta in one read (a short answer the server finished before the client read): no rate.
    rate = (n - 1) / (last - first) if last > first else math.nan
    return (first - t0) * 1000.0, rate, n


async def run(
    backend: str, gw: str, key: str, model: str, served: str, opts: argparse.Namespace
) -> dict[str, list[tuple[float, float, int]]]:
    reqs = requests(model, opts.max_tokens)
    direct_body = dict(reqs["chat"][1], model=served)
    direct_body.update(
        {
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 0,
        }
    )
    targets: dict[str, tuple[str, bytes]] = {
        "direct": (backend + "/v1/chat/completions", orjson.dumps(direct_body))
    }
    for d in DIALECTS:
        path, body = reqs[d]
        targets[d] = (gw + path, orjson.dumps(body))
    headers = {
        "authorization": f"Bearer {key}",
        "x-goog-api-key": key,
        "anthropic-version": "2023-06-01",
        "content-type": "application/json",
    }
    results: dict[str, list[tuple[float, float, int]]] = {t: [] for t in targets}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as http:
        order = list(targets.items())
        for i in range(opts.warmup + opts.calls):
            # In turn, so drift hits every target alike, starting one further each round: a call that
            # follows another at once can find the server still finishing it (seen on the real vLLM).
            k = i % len(order)
            for target, (url, body) in order[k:] + order[:k]:
                out = await one_call(http, target, url, body, headers)
                if i >= opts.warmup:
                    results[target].append(out)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=60, help="timed calls per target")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--token-delay-ms", type=float, default=2.0, help="the fake's delay per token")
    ap.add_argument("--answer-chars", type=int, default=800, help="the fake's answer length (4 bytes/token)")
    ap.add_argument("--vllm", metavar="URL", help="a running vLLM server instead of the fake")
    opts = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-stream-"))
    gport, cport = free_port(), free_port()
    gw, control = f"http://127.0.0.1:{gport}", f"http://127.0.0.1:{cport}"
    token = secrets.token_urlsafe(32)
    procs: list[subprocess.Popen[bytes]] = []
    if opts.vllm:
        backend = opts.vllm.rstrip("/").removesuffix("/v1")
        with urllib.request.urlopen(backend + "/v1/models", timeout=10) as r:
            served = orjson.loads(r.read())["data"][0]["id"]
        label = f"real vLLM at {backend} ({served})"
    else:
        bport = free_port()
        backend, served = f"http://127.0.0.1:{bport}", "m"
        fake = [sys.executable, "-m", "tests.fakes.fake_vllm", "--port", str(bport)]
        fake += ["--token-delay-ms", str(opts.token_delay_ms), "--answer-chars", str(opts.answer_chars)]
        procs.append(start(fake, backend))
        label = f"fake vLLM, {opts.token_delay_ms:g} ms per token"
    argv = [sys.executable, "-m", "polar", "gateway", "--backend", backend, "--backend-kind", "vllm"]
    argv += ["--model", served, "--port", str(gport), "--control-port", str(cport)]
    argv += ["--store", str(tmp / "bench.db"), "--log-level", "warning"]
    try:
        procs.append(start(argv, gw, env={"POLAR_TOKEN": token}))
        req = urllib.request.Request(
            control + "/sessions", data=b'{"task_id": "bench"}', headers={"authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(req) as r:
            key = orjson.loads(r.read())["session_id"]
        results = asyncio.run(run(backend, gw, key, "m", served, opts))
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)

    def rate(rows: list[tuple[float, float, int]]) -> float:
        rates = [r[1] for r in rows if not math.isnan(r[1])]
        return statistics.median(rates) if rates else math.nan

    ttft0 = statistics.median(r[0] for r in results["direct"])
    tps0 = rate(results["direct"])
    print(f"\nStreaming, {label}: {opts.calls} calls per target at concurrency 1, medians\n")
    print("| path | TTFT ms | +TTFT ms | tokens/s | vs direct | text deltas |")
    print("|---|---:|---:|---:|---:|---:|")
    for target, rows in results.items():
        ttft = statistics.median(r[0] for r in rows)
        tps = rate(rows)
        deltas = statistics.median(r[2] for r in rows)
        plus = "" if target == "direct" else f"{ttft - ttft0:+.2f}"
        ratio = "" if target == "direct" else f"{tps / tps0:.2f}"
        print(f"| {target} | {ttft:.2f} | {plus} | {tps:.0f} | {ratio} | {deltas:.0f} |")


if __name__ == "__main__":
    main()
