"""`POST /v1/completions` over raw prompts (text or token ids), in vLLM's shapes.

Token-id prompts go to the model untouched, which is what a trainer wants when it replays exact tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from polar.engine.engine import Engine
from polar.engine.protocol import APIError, CompletionRequest
from polar.engine.sampling import SamplingParams
from polar.engine.scheduler import SeqUpdate
from polar.engine.serving_common import (
    SSE_DONE,
    TokenText,
    check_model,
    check_supported,
    finite,
    resolve_max_tokens,
    sampling_params,
    sse,
    token_text,
)


@dataclass
class CompletionJob:
    req: CompletionRequest
    prompts: list[list[int]]
    max_tokens: list[int]
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def prepare(engine: Engine, req: CompletionRequest) -> CompletionJob:
    check_model(engine, req.model)
    check_supported(req)
    raw = req.prompt
    vocab = len(engine.tokenizer)
    prompts: list[list[int]]
    if isinstance(raw, str):
        prompts = [engine.tokenizer.encode(raw, add_special_tokens=req.add_special_tokens)]
    elif raw and all(isinstance(p, str) for p in raw):
        prompts = [engine.tokenizer.encode(p, add_special_tokens=req.add_special_tokens) for p in raw]
    elif raw and all(isinstance(p, int) for p in raw):
        prompts = [list(raw)]  # type: ignore[arg-type]
    else:
        prompts = [list(p) for p in raw]  # type: ignore[arg-type]
    for p in prompts:
        if not p:
            raise APIError(400, "prompt: empty prompt", param="prompt")
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is out of vocabulary (size {vocab})", param="prompt")
    if req.max_tokens == 0:
        raise APIError(400, "max_tokens: must be at least 1 (echo is not supported)", param="max_tokens")
    max_tokens = [resolve_max_tokens(engine, len(p), req.max_tokens, "max_tokens") for p in prompts]
    return CompletionJob(req, prompts, max_tokens)


def _params(job: CompletionJob, p: int, i: int) -> SamplingParams:
    req = job.req
    return sampling_params(
        req,
        job.max_tokens[p],
        top_logprobs=req.logprobs or 0,
        skip_special_tokens=req.skip_special_tokens,
        seed_offset=i,
    )


def _logprobs(
    names: TokenText, ids: list[int], lps: list[float], tops: list[Any] | None, as_ids: bool
) -> dict[str, Any]:
    tokens = [names(t, as_ids) for t in ids]
    offsets, pos = [], 0
    for t in ids:
        offsets.append(pos)
        pos += len(names(t))
    top_dicts: list[dict[str, float] | None] = []
    for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
        d = {names(t, as_ids): finite(lp)}
        if tops is not None:
            for tid, v in tops[i]:
                d.setdefault(names(tid, as_ids), finite(v))
        top_dicts.append(d)
    return {
        "text_offset": offsets,
        "token_logprobs": [finite(x) for x in lps],
        "tokens": tokens,
        "top_logprobs": top_dicts,
    }


@dataclass
class _Acc:
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tops: list[Any] = field(default_factory=list)
    text: str = ""
    last: SeqUpdate | None = None


async def _collect(engine: Engine, job: CompletionJob, p: int, i: int) -> _Acc:
    acc = _Acc()
    async for upd in engine.generate(job.prompts[p], _params(job, p, i), f"{job.id}-{p}-{i}"):
        acc.ids += upd.token_ids
        acc.lps += upd.logprobs
        if upd.top is not None:
            acc.tops += upd.top
        acc.text += upd.text
        acc.last = upd
    return acc


async def complete(engine: Engine, job: CompletionJob) -> dict[str, Any]:
    req = job.req
    n = req.n
    pairs = [(p, i) for p in range(len(job.prompts)) for i in range(n)]
    results = await asyncio.gather(*(_collect(engine, job, p, i) for p, i in pairs))
    names = token_text(engine)
    as_ids = bool(req.return_tokens_as_token_ids)
    choices = []
    version = engine.policy_version
    for idx, ((p, _), acc) in enumerate(zip(pairs, results, strict=True)):
        if acc.last is None or acc.last.finish_reason == "error":
            raise APIError(500, "Internal server error", kind="InternalServerError")
        version = acc.last.policy_version
        choices.append(
            {
                "index": idx,
                "text": acc.text,
                "logprobs": (
                    _logprobs(names, acc.ids, acc.lps, acc.tops or None, as_ids)
                    if req.logprobs is not None
                    else None
                ),
                "finish_reason": acc.last.finish_reason,
                "stop_reason": acc.last.stop_reason,
                "token_ids": acc.ids if req.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": job.prompts[p] if req.return_token_ids else None,
            }
        )
    prompt_tokens = sum(len(p) for p in job.prompts)
    completion_tokens = sum(len(a.ids) for a in results)
    return {
        "id": job.id,
        "object": "text_completion",
        "created": job.created,
        "model": engine.name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        },
        "kv_transfer_params": None,
        "policy_version": version,
        "polar_flags": [],
    }


async def stream(engine: Engine, job: CompletionJob) -> AsyncIterator[bytes]:
    req = job.req
    names = token_text(engine)
    as_ids = bool(req.return_tokens_as_token_ids)
    pairs = [(p, i) for p in range(len(job.prompts)) for i in range(req.n)]
    queue: asyncio.Queue[tuple[int, SeqUpdate | BaseException]] = asyncio.Queue()

    async def pump(idx: int, p: int, i: int) -> None:
        try:
            async for upd in engine.generate(job.prompts[p], _params(job, p, i), f"{job.id}-{p}-{i}"):
                await queue.put((idx, upd))
        except BaseException as exc:
            await queue.put((idx, exc))
            raise

    tasks = [asyncio.create_task(pump(idx, p, i)) for idx, (p, i) in enumerate(pairs)]
    head = {"id": job.id, "object": "text_completion", "created": job.created, "model": engine.name}
    started: set[int] = set()
    open_choices, completion_tokens = len(pairs), 0
    version = engine.policy_version
    try:
        while open_choices:
            idx, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason == "error":
                yield sse(APIError(500, "Internal server error", kind="InternalServerError").body())
                yield SSE_DONE
                return
            done = item.finish_reason is not None
            open_choices -= done
            completion_tokens += len(item.token_ids)
            version = item.policy_version
            choice: dict[str, Any] = {
                "index": idx,
                "text": item.text,
                "logprobs": (
                    _logprobs(names, item.token_ids, item.logprobs, item.top, as_ids)
                    if req.logprobs is not None
                    else None
                ),
                "finish_reason": item.finish_reason,
                "stop_reason": item.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = item.token_ids
                if idx not in started:
                    choice["prompt_token_ids"] = job.prompts[pairs[idx][0]]
            started.add(idx)
            yield sse({**head, "choices": [choice], "policy_version": version})
        if req.stream_options is not None and req.stream_options.include_usage:
            prompt_tokens = sum(len(p) for p in job.prompts)
            usage = {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
            }
            yield sse({**head, "choices": [], "usage": usage, "policy_version": version})
        yield SSE_DONE
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
