"""Embedded engine throughput: concurrency 1 and 8 through the HTTP server vs sequential `model.generate`.

    PYTHONPATH=src python bench/engine.py [--model MODEL] [--requests 16] [--max-tokens 64]

All three runs use the same model, prompts, sampling (temperature 1, no top-k/top-p) and output length
(EOS ignored), side by side in one process. Throughput is generated tokens per wall-clock second.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import torch
import uvicorn

from polar.chat.render import render_chat
from polar.engine import Engine, EngineConfig, create_engine_app

TOPICS = [
    "the sea",
    "a compiler bug",
    "batching on CPUs",
    "a cat that codes",
    "prime numbers",
    "the history of tea",
    "unit tests",
    "a mountain road",
]


@dataclass
class Row:
    name: str
    concurrency: int
    requests: int
    tokens: int
    seconds: float

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


def _prompts(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


def bench_generate(engine: Engine, prompts: list[list[dict[str, str]]], max_tokens: int) -> Row:
    model, tok = engine.model, engine.tokenizer
    tokens = 0
    start = time.perf_counter()
    for i, messages in enumerate(prompts):
        ids = tok.encode(render_chat(tok, messages), add_special_tokens=False)
        torch.manual_seed(i)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids], device=engine.loaded.device),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=tok.pad_token_id,
            )
        tokens += out.shape[1] - len(ids)
    return Row("model.generate, one at a time", 1, len(prompts), tokens, time.perf_counter() - start)


async def _engine_run(
    url: str, model: str, prompts: list[list[dict[str, str]]], max_tokens: int, conc: int
) -> int:
    queue: asyncio.Queue[tuple[int, list[dict[str, str]]]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    total = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal total
        while not queue.empty():
            i, messages = queue.get_nowait()
            r = await client.post(
                url + "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "seed": i,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "logprobs": True,
                    "top_logprobs": 0,
                },
            )
            r.raise_for_status()
            total += len(r.json()["choices"][0]["token_ids"])

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(conc)))
    return total


def bench_engine(
    url: str, engine: Engine, prompts: list[list[dict[str, str]]], max_tokens: int, conc: int
) -> Row:
    start = time.perf_counter()
    tokens = asyncio.run(_engine_run(url, engine.name, prompts, max_tokens, conc))
    return Row("polar engine over HTTP", conc, len(prompts), tokens, time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF id, folder or .gguf (default: the offline tiny model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    engine = Engine.load(args.model, device=args.device, config=EngineConfig(max_num_seqs=16), start=False)
    app = create_engine_app(engine, manage_engine=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    prompts = _prompts(args.requests)
    warm = _prompts(2)
    bench_generate(engine, warm, 4)
    bench_engine(url, engine, warm, 4, 2)

    rows = [bench_generate(engine, prompts, args.max_tokens)]
    for conc in (1, 8):
        engine.scheduler.prefix_cache.clear()  # no free prefill from the previous run
        rows.append(bench_engine(url, engine, prompts, args.max_tokens, conc))
    server.should_exit = True
    thread.join(timeout=10)

    base = rows[0].tps
    print(
        f"\nmodel: {engine.name} on {engine.loaded.device} ({engine.loaded.dtype}), torch threads {torch.get_num_threads()}"
    )
    print(f"{args.requests} requests x {args.max_tokens} tokens, temperature 1, EOS ignored\n")
    print(
        f"| {'mode':<32} | {'concurrency':>11} | {'tokens':>6} | {'seconds':>7} | {'tokens/s':>8} | {'vs generate':>11} |"
    )
    print(f"|{'-' * 34}|{'-' * 13}|{'-' * 8}|{'-' * 9}|{'-' * 10}|{'-' * 13}|")
    for r in rows:
        print(
            f"| {r.name:<32} | {r.concurrency:>11} | {r.tokens:>6} | {r.seconds:>7.2f} | {r.tps:>8.1f} | {r.tps / base:>10.2f}x |"
        )


if __name__ == "__main__":
    main()
