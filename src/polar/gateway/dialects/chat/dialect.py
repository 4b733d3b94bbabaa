"""OpenAI Chat Completions (`POST /v1/chat/completions`): Qwen Code, OpenCode and Pi speak it.

The canonical request is already Chat-shaped, so parsing is mostly validation plus a few normalizations
(`developer` -> `system`, `reasoning` -> `reasoning_content`, `max_completion_tokens` -> `max_tokens`).
Rendering and streaming answer with the model name the harness asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import orjson

from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk, StreamHead
from polar.gateway.dialects.base import SSEOnly, StreamFormat
from polar.gateway.dialects.chat import schema as s
from polar.gateway.dialects.openai_wire import (
    OPENAI_STYLE,
    error_object,
    settle_tool_choice,
    split_text,
    unix_now,
    upstream_effort,
)
from polar.gateway.dialects.tool_schema import check_tool_schema
from polar.gateway.dialects.validation import validate
from polar.gateway.errors import GatewayError, invalid
from polar.gateway.signatures import ReasoningCodec
from polar.jsontypes import JSON

_DONE = b"data: [DONE]\n\n"


class ChatDialect(SSEOnly):
    """The OpenAI Chat dialect (see `Dialect` in `dialects.base`)."""

    name = "chat"

    def parse(
        self,
        body: JSON,
        codec: ReasoningCodec,
        *,
        path_model: str | None = None,
        path_stream: bool | None = None,
    ) -> CanonicalRequest:
        req = validate(s.REQUEST, body, OPENAI_STYLE)
        n = req.get("n")
        if n is not None and n != 1:
            # Capture records one sampled sequence per call; n > 1 would need n records per call.
            raise invalid(f"Only n=1 is supported (got n={n}).", "n")
        for legacy in ("functions", "function_call"):
            if req.get(legacy) is not None:
                raise invalid(f"'{legacy}' (legacy function calling) is not supported; use 'tools'.", legacy)

        messages = [_message(m) for m in req["messages"]]
        tools = [_tool(t, i) for i, t in enumerate(req.get("tools") or ())] or None

        params: dict[str, Any] = {}
        max_tokens = req.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = req.get("max_tokens")
        stop = req.get("stop")
        for key, value in (
            ("temperature", req.get("temperature")),
            ("top_p", req.get("top_p")),
            ("top_k", req.get("top_k")),
            ("max_tokens", max_tokens),
            ("stop", [stop] if isinstance(stop, str) else stop),
            ("seed", req.get("seed")),
            ("presence_penalty", req.get("presence_penalty")),
            ("frequency_penalty", req.get("frequency_penalty")),
            ("parallel_tool_calls", req.get("parallel_tool_calls")),
            ("chat_template_kwargs", req.get("chat_template_kwargs")),
            ("reasoning_effort", upstream_effort(req.get("reasoning_effort"))),
            ("response_format", _response_format(req.get("response_format"))),
        ):
            if value is not None:
                params[key] = value

        stream_options = req.get("stream_options") or {}
        return CanonicalRequest(
            model=req["model"],
            messages=messages,
            tools=tools,
            tool_choice=_tool_choice(req.get("tool_choice"), tools),
            params=params,
            stream=bool(req.get("stream")),
            render={"model": req["model"], "include_usage": bool(stream_options.get("include_usage"))},
        )

    def render(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> dict[str, Any]:
        return {
            "id": comp.id,
            "object": "chat.completion",
            "created": comp.created or unix_now(),
            "model": req.render.get("model", req.model),
            "choices": [
                {
                    "index": 0,
                    "message": comp.message(),
                    "logprobs": None,
                    "finish_reason": comp.finish_reason,
                }
            ],
            "usage": _usage(comp),
        }

    def stream(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> Iterator[bytes]:
        w = ChatChunkWriter(comp.id, comp.created or unix_now(), req.render.get("model", req.model))
        yield w.role()
        if comp.reasoning:
            for piece in split_text(comp.reasoning):
                yield w.reasoning(piece)
        if comp.content:
            for piece in split_text(comp.content):
                yield w.content(piece)
        for index, tc in enumerate(comp.tool_calls):
            yield w.tool_call_start(index, tc.id, tc.name)
            for piece in split_text(tc.arguments, parts=3):
                if piece:
                    yield w.tool_call_args(index, piece)
        yield w.finish(comp.finish_reason)
        if req.render.get("include_usage"):
            yield w.usage(_usage(comp))
        yield _DONE

    def stream_encoder(
        self, req: CanonicalRequest, codec: ReasoningCodec, fmt: StreamFormat
    ) -> ChatStreamEncoder:
        self._sse_only(fmt)
        return ChatStreamEncoder(req)

    def error(self, err: GatewayError) -> tuple[int, dict[str, Any]]:
        return err.status, {"error": _error_object(err)}

    def stream_error(self, err: GatewayError) -> bytes:
        # The openai SDK raises `APIError` on any SSE data with a top-level "error" key (openai-python
        # `Stream.__stream__`); `[DONE]` then closes the stream for clients that keep reading.
        return _stream_error(err)

    def stream_error_status(self, err: GatewayError) -> int:
        return 200


class ChatChunkWriter:
    """Writes `chat.completion.chunk` SSE frames, one method per kind of delta.

    `ChatDialect.stream` drives it from a finished `Completion`; an incremental upstream can call the same
    methods as tokens arrive. The constant head of every chunk (id, created, model) is encoded once.
    """

    __slots__ = ("_head",)

    def __init__(self, chunk_id: str, created: int, model: str) -> None:
        self._head = (
            b'data: {"id":'
            + orjson.dumps(chunk_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(model)
            + b',"choices":['
        )

    def _delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._head + orjson.dumps(choice) + b"]}\n\n"

    def role(self) -> bytes:
        return self._delta({"role": "assistant", "content": ""})

    def reasoning(self, piece: str) -> bytes:
        return self._delta({"reasoning_content": piece})

    def content(self, piece: str) -> bytes:
        return self._delta({"content": piece})

    def tool_call_start(self, index: int, call_id: str, name: str) -> bytes:
        call = {
            "index": index,
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        return self._delta({"tool_calls": [call]})

    def tool_call_args(self, index: int, piece: str) -> bytes:
        return self._delta({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})

    def finish(self, finish_reason: str) -> bytes:
        return self._delta({}, finish_reason)

    def usage(self, usage: dict[str, int]) -> bytes:
        """The trailing `stream_options.include_usage` chunk: no choices, only usage."""
        return self._head + b'],"usage":' + orjson.dumps(usage) + b"}\n\n"


class ChatStreamEncoder:
    """A Chat stream as it is sampled (a `StreamEncoder`): the role chunk on `open`; every reasoning, text
    and tool-call piece as its own chunk (a call's first chunk carries its id and name, then its argument
    pieces); `close` sends the finish reason (only known at the end: vLLM reports "stop" for a forced tool
    call, which the gateway reports as "tool_calls"), the usage chunk when the harness asked for it, and
    `[DONE]`. Nothing is held back."""

    __slots__ = ("_req", "_started", "_w")

    def __init__(self, req: CanonicalRequest) -> None:
        self._req = req
        self._w: ChatChunkWriter | None = None
        self._started: set[int] = set()

    def open(self, head: StreamHead) -> bytes:
        self._w = ChatChunkWriter(
            head.id, head.created or unix_now(), self._req.render.get("model", self._req.model)
        )
        return self._w.role()

    def delta(self, chunk: StreamChunk) -> bytes:
        w = self._w
        assert w is not None
        out = b""
        if chunk.reasoning:
            out += w.reasoning(chunk.reasoning)
        if chunk.content:
            out += w.content(chunk.content)
        for tc in chunk.tool_calls:
            if tc.index not in self._started:
                self._started.add(tc.index)
                out += w.tool_call_start(tc.index, tc.call_id, tc.name or "")
            if tc.arguments:
                out += w.tool_call_args(tc.index, tc.arguments)
        return out

    def close(self, comp: Completion) -> bytes:
        w = self._w
        assert w is not None
        out = w.finish(comp.finish_reason)
        if self._req.render.get("include_usage"):
            out += w.usage(_usage(comp))
        return out + _DONE

    def fail(self, err: GatewayError) -> bytes:
        return _stream_error(err)


def _stream_error(err: GatewayError) -> bytes:
    return b"data: " + orjson.dumps({"error": _error_object(err)}) + b"\n\n" + _DONE


def _usage(comp: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": comp.prompt_tokens,
        "completion_tokens": comp.completion_tokens,
        "total_tokens": comp.prompt_tokens + comp.completion_tokens,
    }


def _error_object(err: GatewayError) -> dict[str, Any]:
    if err.kind == "context_length":
        message = err.message
        if err.prompt_tokens is not None and err.max_tokens is not None:
            # OpenAI's wording; agent frameworks match on it to trigger history compaction.
            message = (
                f"This model's maximum context length is {err.max_tokens} tokens. However, your messages "
                f"resulted in {err.prompt_tokens} tokens. Please reduce the length of the messages."
            )
        return error_object(err, message, param=err.param or "messages")
    return error_object(err)


def _message(m: Any) -> dict[str, Any]:
    """One canonical message. Pydantic built `m` as a fresh dict holding only declared keys, in the
    canonical Chat shape already, so it is adjusted in place rather than copied."""
    role = m["role"]
    if role == "developer":
        m["role"] = "system"  # OpenAI's newer name for `system`; chat templates only know `system`
    elif role == "assistant":
        content = m.get("content")
        if isinstance(content, list):
            # The model produced one string; parts are a client's re-wrapping of it.
            m["content"] = "".join(p["text"] if p["type"] == "text" else p["refusal"] for p in content)
        elif "content" not in m:
            m["content"] = None
        reasoning = m.pop("reasoning", None)
        if m.get("reasoning_content") is None:
            m.pop("reasoning_content", None)
            if reasoning is not None:
                m["reasoning_content"] = reasoning
        calls = m.get("tool_calls")
        if calls:
            for call in calls:
                call["type"] = "function"
        else:
            m.pop("tool_calls", None)
    return cast(dict[str, Any], m)


def _response_format(value: Any) -> dict[str, Any] | None:
    """A JSON `response_format` as sent (the server constrains its sampling to it); `text`, the default,
    is left out so the upstream body of a harness that spells it out stays what it always was."""
    if not isinstance(value, dict) or value.get("type") == "text":
        return None
    return value


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    if isinstance(choice, dict) and tools:
        name = choice["function"]["name"]
        if all(t["function"]["name"] != name for t in tools):
            raise invalid(
                f"Invalid value for 'tool_choice.function.name': {name!r} is not one of the request's tools.",
                "tool_choice.function.name",
            )
    return settle_tool_choice(choice, bool(tools))


def _tool(t: Any, i: int) -> dict[str, Any]:
    """A chat function tool with only the fields the template and upstream use."""
    fn = t["function"]
    out: dict[str, Any] = {"name": fn["name"]}
    if fn.get("description") is not None:
        out["description"] = fn["description"]
    if fn.get("parameters") is not None:
        check_tool_schema(fn["parameters"], f"tools[{i}]", fn["name"], "function.parameters")
        out["parameters"] = fn["parameters"]
    return {"type": "function", "function": out}
