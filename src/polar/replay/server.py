"""The replay server: a recorded session served back in vLLM's shapes, so a gateway (and the harness behind it)
cannot tell it from the policy that was recorded.

Routes: `POST /v1/chat/completions` (whole answers and vLLM 0.32's stream: a first chunk with
`prompt_token_ids`, one chunk per sampled token with its id and logprob, the last with `finish_reason`, a
usage chunk, `[DONE]`), `POST /tokenize` (the recorded prompt length of a recorded prompt), `GET /v1/models`,
`GET /health`. A request that is not a recorded call is answered 409, naming where it first differs.

The recording holds each call's whole answer, not its per-token text: a replayed stream gives the answer's
text fields in its first token chunks and empty deltas for the rest (as vLLM does for tokens whose text a
parser holds back). The ids, logprobs and the assembled message are the recorded ones, which is what the
gateway records and trains on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from polar import jsontypes
from polar.replay.recording import Mismatch, Recording
from polar.store.records import CompletionRecord

log = logging.getLogger("polar.replay")
JSON = "application/json"


def _json(data: jsontypes.JSON, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type=JSON)


def _error(status: int, message: str, kind: str) -> Response:
    return _json({"error": {"message": message, "type": kind, "code": status}}, status)


def _logprobs(record: CompletionRecord, lo: int = 0, hi: int | None = None) -> dict[str, Any] | None:
    if record.response_logprobs is None:
        return None
    values = record.response_logprobs[lo:hi]
    return {"content": [{"token": "", "logprob": v, "bytes": None, "top_logprobs": []} for v in values]}


def _usage(record: CompletionRecord) -> dict[str, int]:
    prompt = int(record.usage.get("prompt_tokens", len(record.prompt_ids or ())))
    completion = int(record.usage.get("completion_tokens", len(record.response_ids or ())))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _head(record: CompletionRecord) -> dict[str, Any]:
    head: dict[str, Any] = {
        "id": f"chatcmpl-replay-{record.seq}",
        "created": int(record.created_at),
        "model": record.model_served,
    }
    if record.policy_version is not None:
        head["policy_version"] = record.policy_version
    return head


def whole_answer(record: CompletionRecord) -> dict[str, Any]:
    """The recorded call as vLLM's `chat.completion` body."""
    message = {"role": "assistant", **record.response_message}
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": record.finish_reason,
        "token_ids": list(record.response_ids or ()),
        "logprobs": _logprobs(record),
    }
    return {
        **_head(record),
        "object": "chat.completion",
        "prompt_token_ids": list(record.prompt_ids or ()),
        "choices": [choice],
        "usage": _usage(record),
    }


def _pieces(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's text fields as deltas, one per field (each tool call whole, as its first piece)."""
    out: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        out.append({"reasoning": reasoning})
    if message.get("content"):
        out.append({"content": message["content"]})
    for j, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        piece = {"index": j, "id": call.get("id"), "type": "function", "function": dict(fn)}
        out.append({"tool_calls": [piece]})
    return out


def _merge(into: dict[str, Any], piece: dict[str, Any]) -> None:
    for key, value in piece.items():
        if key == "tool_calls":
            into.setdefault("tool_calls", []).extend(value)
        else:
            into[key] = into.get(key, "") + value


def stream_chunks(record: CompletionRecord, include_usage: bool) -> list[bytes]:
    """The recorded call as vLLM 0.32's SSE stream (see the module docstring)."""
    head = {**_head(record), "object": "chat.completion.chunk"}
    ids = list(record.response_ids or ())
    first = {
        **head,
        "prompt_token_ids": list(record.prompt_ids or ()),
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}],
    }  # fmt: skip
    events = [first]
    pieces = _pieces(record.response_message)
    n = max(len(ids), 1)
    deltas: list[dict[str, Any]] = [{} for _ in range(n)]
    for k, piece in enumerate(pieces):  # one field per token from the first; the rest share the last
        _merge(deltas[min(k, n - 1)], piece)
    for i, delta in enumerate(deltas):
        choice = {
            "index": 0,
            "delta": delta,
            "token_ids": ids[i : i + 1],
            "logprobs": _logprobs(record, i, i + 1),
            "finish_reason": record.finish_reason if i == n - 1 else None,
        }
        events.append({**head, "choices": [choice]})
    if include_usage:
        events.append({**head, "choices": [], "usage": _usage(record)})
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def create_replay_app(recording: Recording) -> Starlette:
    """The ASGI app serving `recording` (see the module docstring)."""

    async def chat(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"the body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        found = recording.take(body)
        if isinstance(found, Mismatch):
            log.warning("replay: %s", found.message())
            return _error(409, found.message(), "replay_mismatch")
        log.info("replay: answered call seq %d (%d left)", found.seq, recording.remaining)
        if not body.get("stream"):
            return _json(whole_answer(found))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def chunks() -> AsyncIterator[bytes]:
            for chunk in stream_chunks(found, include_usage):
                yield chunk

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def tokenize(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"the body is not JSON: {exc}", "invalid_request_error")
        count = recording.prompt_length(body.get("messages") if isinstance(body, dict) else None)
        if count is None:
            return _error(
                409, "no recorded call has these messages: a replay cannot tokenize", "replay_mismatch"
            )
        return _json({"count": count, "max_model_len": None, "tokens": []})

    async def models(request: Request) -> Response:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "polar-replay"} for m in recording.models
        ]
        return _json({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        return _json({"status": "ok", "service": "polar-replay", "calls_left": recording.remaining})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )
