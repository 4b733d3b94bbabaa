"""Streamed chat answers: one upstream chunk as a `StreamChunk`, and the finished `Completion` they add up to.

An OpenAI Chat stream (`stream: true`) is a series of `chat.completion.chunk` objects. vLLM 0.32 sends, with
`return_token_ids`, `logprobs` and `stream_options.include_usage`: a first chunk with top-level
`prompt_token_ids` and an empty assistant delta; then per engine step one chunk whose `choices[0]` has the
delta (`content`, `reasoning` or older `reasoning_content`, `tool_calls[k]` pieces with an `index`, the first
piece carrying `id` and `function.name`), `token_ids` (the ids sampled in that step, sent even when the
parsers hold the text back) and `logprobs.content` (one entry per id); the last of them has `finish_reason`;
then a chunk with no choices and `usage`; then `data: [DONE]`.

`parse_chunk` reads one decoded chunk into a `StreamChunk` (`polar.gateway.canonical`) (the kind's `read_tokens` finds its token data, exactly as for a whole
answer), `StreamAccumulator` adds the chunks up. Token data is never repaired: a chunk that carries output
without ids (or ids without logprobs) makes the record's ids (logprobs) None, and a count of sampled ids that
differs from `usage.completion_tokens` is flagged; any of these makes the record untrainable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from polar.gateway.backends.base import assemble, upstream_error
from polar.gateway.canonical import Completion, StreamChunk, StreamHead, ToolCallDelta
from polar.gateway.errors import GatewayError
from polar.jsontypes import JSON
from polar.store.records import FLAG_NOT_TRAINABLE, FLAG_TOKEN_COUNT_MISMATCH


def _text(delta: dict[str, Any], key: str) -> str | None:
    value = delta.get(key)
    if value is None or isinstance(value, str):
        return value
    raise upstream_error(f"inference server stream chunk's `delta.{key}` is not a string")


def _tool_deltas(raw: JSON) -> tuple[ToolCallDelta, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise upstream_error("inference server stream chunk's `delta.tool_calls` is not a list")
    out: list[ToolCallDelta] = []
    for k, item in enumerate(raw):
        if not isinstance(item, dict):
            raise upstream_error(f"inference server stream chunk's `delta.tool_calls[{k}]` is not an object")
        index = item.get("index", k)
        if type(index) is not int or index < 0:
            raise upstream_error(f"inference server stream chunk's `delta.tool_calls[{k}].index` is invalid")
        fn = item.get("function") or {}
        if not isinstance(fn, dict):
            raise upstream_error(
                f"inference server stream chunk's `delta.tool_calls[{k}].function` is invalid"
            )
        call_id, name, args = item.get("id"), fn.get("name"), fn.get("arguments")
        if isinstance(
            args, dict
        ):  # a few OpenAI-compatible servers send an object; JSON text is the contract
            args = orjson.dumps(args).decode()
        out.append(
            ToolCallDelta(
                index=index,
                id=call_id if isinstance(call_id, str) and call_id else None,
                name=name if isinstance(name, str) and name else None,
                arguments=args if isinstance(args, str) else "",
            )
        )
    return tuple(out)


def parse_chunk(
    data: JSON,
    read_tokens: Callable[[dict[str, Any], dict[str, Any]], Any],
    read_content: Callable[[dict[str, Any]], str | None],
    read_reasoning: Callable[[dict[str, Any]], str | None],
) -> StreamChunk:
    """One decoded `chat.completion.chunk`; raises `GatewayError` for an error event or a shapeless chunk.

    `read_tokens(data, choice)` is the backend kind's reader of token data (the same one that reads a whole
    answer: vLLM puts `prompt_token_ids` at the top and `token_ids`/`logprobs` in the choice either way)."""
    if not isinstance(data, dict):
        raise upstream_error(
            f"inference server sent a stream chunk that is not an object ({type(data).__name__})"
        )
    if "error" in data and "choices" not in data:
        raise stream_error(data)
    choices = data.get("choices")
    if choices is not None and not isinstance(choices, list):
        raise upstream_error("inference server stream chunk's `choices` is not a list")
    cid, model, created = data.get("id"), data.get("model"), data.get("created")
    chunk = StreamChunk(
        id=cid if isinstance(cid, str) else "",
        model=model if isinstance(model, str) else "",
        created=created if type(created) is int else 0,
    )
    usage = data.get("usage")
    if isinstance(usage, dict):
        chunk.usage = usage
    choice = choices[0] if choices else None
    if choice is None:
        tokens = read_tokens(data, {})
        chunk.prompt_ids = tokens.prompt_ids
        chunk.policy_version, chunk.flags = tokens.policy_version, tokens.flags
        return chunk
    if not isinstance(choice, dict):
        raise upstream_error("inference server stream chunk's `choices[0]` is not an object")
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict):
        raise upstream_error("inference server stream chunk's `choices[0].delta` is not an object")
    chunk.has_choice = True
    chunk.content = read_content(delta)
    chunk.reasoning = read_reasoning(delta)
    chunk.tool_calls = _tool_deltas(delta.get("tool_calls"))
    chunk.finish_reason = choice.get("finish_reason")
    tokens = read_tokens(data, choice)
    chunk.prompt_ids, chunk.token_ids, chunk.logprobs, chunk.text = (
        tokens.prompt_ids,
        tokens.response_ids,
        tokens.logprobs,
        tokens.text,
    )
    chunk.policy_version, chunk.flags = tokens.policy_version, tokens.flags
    return chunk


def stream_error(data: dict[str, Any]) -> GatewayError:
    """The `GatewayError` for an in-stream error event (`{"error": {...}}`, vLLM's and OpenAI's shape)."""
    err = data.get("error")
    message = err.get("message") if isinstance(err, dict) else err
    if not isinstance(message, str):
        message = "(no message)"
    return upstream_error(f"inference server failed mid-stream: {message}")


def whole_chunk(comp: Completion) -> StreamChunk:
    """A finished completion as the one chunk of a stream (for servers that are not streamed from)."""
    calls = tuple(ToolCallDelta(i, tc.id, tc.name, tc.arguments) for i, tc in enumerate(comp.tool_calls))
    return StreamChunk(
        id=comp.id,
        model=comp.model,
        created=comp.created,
        content=comp.content,
        reasoning=comp.reasoning,
        tool_calls=calls,
        finish_reason=comp.finish_reason,
        has_choice=True,
        prompt_ids=comp.prompt_ids,
        token_ids=comp.response_ids,
        logprobs=comp.response_logprobs,
        usage={"prompt_tokens": comp.prompt_tokens, "completion_tokens": comp.completion_tokens},
        policy_version=comp.policy_version,
        whole=comp,
    )


class StreamAccumulator:
    """Adds up a stream's chunks; `completion()` is the `Completion` a whole answer would have given."""

    def __init__(self) -> None:
        self.id = ""
        self.model = ""
        self.created = 0
        self.chunks = 0
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, list[Any]] = {}  # index -> [id, name, [argument pieces]]
        self._finish: JSON = None
        self.prompt_ids: Sequence[int] | None = None
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._ids_missing = False
        self._lps_missing = False
        self._text: list[str] | None = []  # None once a chunk with ids came without their text
        self._saw_ids = False
        self._saw_lps = False
        self._usage: dict[str, Any] | None = None
        self._version: int | None = None
        self._flags: list[str] = []
        self._whole: Completion | None = None

    def head(self) -> StreamHead:
        return StreamHead(self.id, self.model, self.created, self.prompt_tokens)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length as far as it is known yet (for events that announce it before the end)."""
        if self.prompt_ids is not None:
            return len(self.prompt_ids)
        p = self._usage.get("prompt_tokens") if self._usage else None
        return p if type(p) is int else 0

    def add(self, c: StreamChunk) -> None:
        self.chunks += 1
        if c.whole is not None:
            self._whole = c.whole
        self.id = self.id or c.id
        self.model = self.model or c.model
        self.created = self.created or c.created
        if c.prompt_ids is not None and self.prompt_ids is None:
            self.prompt_ids = c.prompt_ids
        if c.usage is not None:
            self._usage = c.usage
        if c.policy_version is not None:
            self._version = c.policy_version
        self._flags += [f for f in c.flags if f not in self._flags]
        if not c.has_choice:
            return
        if c.content:
            self._content.append(c.content)
        if c.reasoning:
            self._reasoning.append(c.reasoning)
        for tc in c.tool_calls:
            slot = self._calls.get(tc.index)
            if slot is None:
                if tc.name is None:
                    raise upstream_error(
                        f"inference server streamed tool call {tc.index} without `function.name` in its first piece"
                    )
                slot = self._calls[tc.index] = [tc.call_id, tc.name, []]
            if tc.arguments:
                slot[2].append(tc.arguments)
        if c.finish_reason is not None:
            self._finish = c.finish_reason
        self._tokens(c)

    def _tokens(self, c: StreamChunk) -> None:
        if c.token_ids is not None:
            self._saw_ids = True
            self._ids += c.token_ids
        elif c.has_output:
            self._ids_missing = True  # text without the ids it came from
        if self._text is not None:
            if c.text is not None:
                self._text.append(c.text)
            elif c.token_ids:
                self._text = None
        if c.logprobs is not None:
            self._saw_lps = True
            self._lps += c.logprobs
        elif c.token_ids:
            self._lps_missing = True  # ids without their logprobs

    def completion(self) -> Completion:
        """The finished completion; raises `GatewayError` where a whole answer would (abort, unknown finish)."""
        if self._whole is not None:
            return self._whole
        if self._finish is None:
            raise upstream_error("inference server ended the stream without a finish_reason")
        response_ids = self._ids if self._saw_ids and not self._ids_missing else None
        logprobs = self._lps if self._saw_lps and not self._lps_missing else None
        flags = list(self._flags)
        u = self._usage or {}
        counted = u.get("completion_tokens")
        if response_ids is not None and type(counted) is int and counted != len(response_ids):
            flags += [FLAG_TOKEN_COUNT_MISMATCH, FLAG_NOT_TRAINABLE]
        message: dict[str, Any] = {}
        if self._calls:
            message["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": "".join(args)}}
                for _, (cid, name, args) in sorted(self._calls.items())
            ]
        data = {"id": self.id, "model": self.model, "created": self.created, "usage": self._usage}
        return assemble(
            data,
            {"finish_reason": self._finish},
            message,
            content="".join(self._content) or None,
            reasoning="".join(self._reasoning) or None,
            prompt_ids=self.prompt_ids,
            response_ids=response_ids,
            logprobs=logprobs,
            policy_version=self._version,
            extra_flags=flags,
            sampled_text="".join(self._text) if self._text is not None and self._saw_ids else None,
        )
