"""Concurrent requests are batched, and every one of them still records exactly what was sampled."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.engine_support import reference_logprobs, tiny_server

PROMPTS = [
    "hi",
    "Summarize the plot of a long novel about the sea, the whale, and a captain who will not let go.",
    "List three prime numbers.",
    "Write a haiku about batching.",
    "What is 2 + 2? Answer briefly and explain nothing else at all, please.",
    "ok",
]


async def _ask(
    client: openai.AsyncOpenAI, model: str, prompt: str, seed: int, delay: float
) -> dict[str, Any]:
    await asyncio.sleep(delay)
    resp = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=16 + seed % 5,
        seed=seed,
        temperature=0.9,
        extra_body={"return_token_ids": True, "logprobs": True, "top_logprobs": 0},
    )
    return resp.model_dump()


async def test_concurrent_sessions_are_batched_and_recorded_exactly() -> None:
    with tiny_server() as (engine, srv):
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        # Staggered starts: later requests join a batch that is already decoding.
        results = await asyncio.gather(
            *(_ask(client, engine.name, p, seed=i, delay=0.02 * i) for i, p in enumerate(PROMPTS))
        )
        stats = engine.scheduler.stats
        assert stats.max_batch >= 3, stats
        assert stats.batched_steps > 0
        for i, body in enumerate(results):
            choice = body["choices"][0]
            assert len(choice["token_ids"]) == 16 + i % 5 == body["usage"]["completion_tokens"]
            got = [e["logprob"] for e in choice["logprobs"]["content"]]
            want = reference_logprobs(
                engine.model, body["prompt_token_ids"], choice["token_ids"], temperature=0.9
            )
            assert got == pytest.approx(want, abs=2e-3)
        # Batch composition does not change what a seeded request samples.
        for i in (0, 1):
            solo = await _ask(client, engine.name, PROMPTS[i], seed=i, delay=0)
            assert solo["choices"][0]["token_ids"] == results[i]["choices"][0]["token_ids"]
        await client.close()


def test_prefix_cache_reuses_a_repeated_prompt_without_changing_results() -> None:
    with tiny_server() as (engine, srv):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        history = [{"role": "user", "content": "Read the repository and fix the failing test. " * 20}]

        def ask() -> dict[str, Any]:
            return client.chat.completions.create(
                model=engine.name,
                messages=history,
                max_tokens=8,
                seed=11,
                extra_body={"return_token_ids": True, "logprobs": True, "top_logprobs": 0},
            ).model_dump()

        first, second = ask(), ask()
        assert first["usage"]["prompt_tokens_details"] is None
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == len(second["prompt_token_ids"]) - 1
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        # The next turn extends the prompt: only the new tail is prefilled, logprobs stay exact.
        history += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "continue"},
        ]
        third = ask()
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
        choice = third["choices"][0]
        want = reference_logprobs(engine.model, third["prompt_token_ids"], choice["token_ids"])
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(want, abs=2e-3)
