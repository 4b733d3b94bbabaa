"""`POST /v1/chat/completions`: vLLM's response shapes, plus `policy_version` and `polar_flags`.

Streaming holds back text that a later token could turn into reasoning or a tool call; once a tool call
starts, its text is buffered and sent as structured `tool_calls` when the choice ends (one delta per
call), or as plain content with the `tool_call_parse_error` flag when it does not parse.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from polar.chat.reasoning import prompt_opens_thought, split_reasoning
from polar.chat.render import ChatTemplateError, render_chat
from polar.chat.stream import AnswerStream
from polar.chat.tool_parsers import ToolParser, chat_calls
from polar.engine.engine import Engine
from polar.engine.protocol import APIError, ChatCompletionRequest
from polar.engine.sampling import SamplingParams
from polar.engine.scheduler import SeqUpdate
from polar.engine.serving_common import (
    SSE_DONE,
    chat_logprob_entries,
    check_model,
    check_supported,
    resolve_max_tokens,
    sampling_params,
    sse,
    token_text,
)

FLAG_TOOL_PARSE_ERROR = "tool_call_parse_error"


@dataclass
class ChatJob:
    """A validated request, rendered and tokenized, ready to generate."""

    req: ChatCompletionRequest
    prompt_text: str
    prompt_ids: list[int]
    max_tokens: int
    parser: ToolParser | None
    tools: list[dict[str, Any]] | None
    reasoning: bool
    opened: bool
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def prepare(engine: Engine, req: ChatCompletionRequest) -> ChatJob:
    check_model(engine, req.model)
    check_supported(req)
    if req.chat_template is not None and not engine.config.trust_request_chat_template:
        raise APIError(
            400,
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template.",
            param="chat_template",
        )
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    tools = [t.model_dump() for t in req.tools] if req.tools else None
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    try:
        text = render_chat(
            engine.tokenizer,
            [m.model_dump() for m in req.messages],
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=kwargs,
            chat_template=req.chat_template,
        )
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    ids = list(engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(engine, len(ids), req.max_completion_tokens or req.max_tokens, param)
    parser = engine.tool_parser if tools and req.tool_choice != "none" else None
    return ChatJob(
        req=req,
        prompt_text=text,
        prompt_ids=ids,
        max_tokens=max_tokens,
        parser=parser,
        tools=tools,
        reasoning=engine.reasoning,
        opened=engine.reasoning and prompt_opens_thought(text),
    )


def _params(job: ChatJob, index: int) -> SamplingParams:
    req = job.req
    skip = req.skip_special_tokens and not (job.parser is not None and job.parser.needs_special_tokens)
    top = (req.top_logprobs or 0) if req.logprobs else 0
    return sampling_params(req, job.max_tokens, top_logprobs=top, skip_special_tokens=skip, seed_offset=index)


@dataclass
class _Collected:
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    last: SeqUpdate | None = None


async def _collect(engine: Engine, job: ChatJob, index: int) -> _Collected:
    out = _Collected()
    async for upd in engine.generate(job.prompt_ids, _params(job, index), f"{job.id}-{index}"):
        out.ids += upd.token_ids
        out.lps += upd.logprobs
        if upd.top is not None:
            out.tops += upd.top
        out.text += upd.text
        out.last = upd
    return out


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if cached else None,
    }


async def complete(engine: Engine, job: ChatJob) -> dict[str, Any]:
    req = job.req
    results = await asyncio.gather(*(_collect(engine, job, i) for i in range(req.n)))
    names = token_text(engine)
    choices, flags = [], []
    version = engine.policy_version
    for i, res in enumerate(results):
        last = res.last
        if last is None or last.finish_reason == "error":
            raise APIError(500, "Internal server error", kind="InternalServerError")
        version = last.policy_version
        reasoning, content = (
            split_reasoning(res.text, job.opened) if job.reasoning else (None, res.text or None)
        )
        if not req.include_reasoning:
            reasoning = None
        calls: list[dict[str, Any]] = []
        choice_flags: list[str] = []
        if job.parser is not None and content:
            parsed = job.parser.parse(content, job.tools)
            if parsed.error is not None:
                choice_flags.append(FLAG_TOOL_PARSE_ERROR)
            else:
                calls, content = chat_calls(parsed.calls), parsed.content
        flags += [f for f in choice_flags if f not in flags]
        message = {
            "role": "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": calls,
            "reasoning": reasoning,
            "reasoning_content": reasoning,
        }
        logprobs = None
        if req.logprobs:
            tops = res.tops if res.tops else None
            logprobs = {
                "content": chat_logprob_entries(
                    names, res.ids, res.lps, tops, bool(req.return_tokens_as_token_ids)
                )
            }
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": "tool_calls" if calls else last.finish_reason,
                "stop_reason": last.stop_reason,
                "token_ids": res.ids if req.return_token_ids else None,
                "polar_flags": choice_flags,
            }
        )
    cached = results[0].last.cached_tokens if results and results[0].last else 0
    return {
        "id": job.id,
        "object": "chat.completion",
        "created": job.created,
        "model": engine.name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(len(job.prompt_ids), sum(len(r.ids) for r in results), cached),
        "prompt_logprobs": None,
        "prompt_token_ids": job.prompt_ids if req.return_token_ids else None,
        "kv_transfer_params": None,
        "policy_version": version,
        "polar_flags": flags,
    }


@dataclass
class _ChoiceStream:
    answer: AnswerStream  # the gateway's rendering backend reads its streams with the same class
    flags: list[str] = field(default_factory=list)


async def stream(engine: Engine, job: ChatJob) -> AsyncIterator[bytes]:
    req = job.req
    names = token_text(engine)
    as_ids = bool(req.return_tokens_as_token_ids)
    queue: asyncio.Queue[tuple[int, SeqUpdate | BaseException]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for upd in engine.generate(job.prompt_ids, _params(job, i), f"{job.id}-{i}"):
                await queue.put((i, upd))
        except BaseException as exc:  # surface to the consumer, then re-raise (cancellation included)
            await queue.put((i, exc))
            raise

    tasks = [asyncio.create_task(pump(i)) for i in range(req.n)]
    states = [
        _ChoiceStream(AnswerStream(job.reasoning, job.opened, job.parser, job.tools)) for _ in range(req.n)
    ]
    head = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": engine.name}
    version = engine.policy_version
    completion_tokens, cached, open_choices = 0, 0, req.n
    try:
        for i in range(req.n):
            first: dict[str, Any] = {
                **head,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                "policy_version": version,
            }
            if req.return_token_ids and i == 0:
                first["prompt_token_ids"] = job.prompt_ids
            yield sse(first)
        while open_choices:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            upd = item
            if upd.finish_reason == "error":
                err = APIError(500, "Internal server error", kind="InternalServerError")
                yield sse(err.body())
                yield SSE_DONE
                return
            st = states[i]
            done = upd.finish_reason is not None
            version, cached = upd.policy_version, upd.cached_tokens
            completion_tokens += len(upd.token_ids)
            delta: dict[str, Any] = {}
            r, content, parsed = st.answer.feed(upd.text, final=done)
            if r and req.include_reasoning:
                delta["reasoning"] = delta["reasoning_content"] = r
            if done and st.answer.error is not None:
                st.flags.append(FLAG_TOOL_PARSE_ERROR)
            calls = [{"index": k, **c} for k, c in enumerate(chat_calls(parsed))]
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            finish = ("tool_calls" if calls else upd.finish_reason) if done else None
            wants_tokens = bool(req.return_token_ids or req.logprobs)
            if not delta and not done and not wants_tokens:
                continue
            choice: dict[str, Any] = {
                "index": i,
                "delta": delta,
                "logprobs": (
                    {"content": chat_logprob_entries(names, upd.token_ids, upd.logprobs, upd.top, as_ids)}
                    if req.logprobs
                    else None
                ),
                "finish_reason": finish,
                "stop_reason": upd.stop_reason if done else None,
            }
            if req.return_token_ids:
                choice["token_ids"] = upd.token_ids
            chunk: dict[str, Any] = {**head, "choices": [choice], "policy_version": version}
            if done:
                open_choices -= 1
                choice["polar_flags"] = st.flags
                chunk["polar_flags"] = [f for s in states for f in s.flags]
            yield sse(chunk)
        opts = req.stream_options
        if opts is not None and opts.include_usage:
            yield sse(
                {
                    **head,
                    "choices": [],
                    "usage": _usage(len(job.prompt_ids), completion_tokens, cached),
                    "policy_version": version,
                    "polar_flags": [f for s in states for f in s.flags],
                }
            )
        yield SSE_DONE
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
