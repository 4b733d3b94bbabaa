"""The fake inference server's streamed answers, in exactly real vLLM 0.32's chunk shape.

Measured on the real server (docs/backends.md; tests/test_vllm_real.py runs the same calls against it): with `return_token_ids`,
`logprobs` and `stream_options.include_usage`, the first chunk carries top-level `prompt_token_ids` and an
empty assistant delta (`{"role": "assistant", "content": ""}`); then one chunk per sampled token, whose
`choices[0]` has the text that token completes (`delta.content`, `delta.reasoning`, or a
`delta.tool_calls[k]` piece with its `index`; the call's first piece carries `id`, `type` and
`function.name`), `token_ids` (that one id) and `logprobs.content` (that one entry), also when the token's
text is markup the parsers swallow (`<think>`, `<tool_call>`: an empty delta); the last token's chunk has
`finish_reason`; then a chunk with no choices and `usage`; then `data: [DONE]`.

A stream is cut from the whole answer the fake would have sent (after its `transform`), so a test compares
a streamed record with the same body a non-streamed call gets. The text of each token is attributed to the
message field it falls in by walking the assistant turn's text byte by byte (`assistant_text`), with one
incremental UTF-8 decoder per field, as a detokenizer does.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from tests.fakes.chatml import FakeTokenizer

Field = str | tuple[str, int]  # "reasoning", "content", ("args", j), or "" for markup


@dataclass
class StreamFaults:
    """Switchable faults of streamed answers (attributes of `FakeInferenceServer.streaming`).

    `token_delay_s`: sleep before each token chunk. `drop_after_tokens`: after N token chunks the connection
    is dropped mid-answer (no `[DONE]`, the chunked body unterminated). `error_after_tokens`: after N token
    chunks an in-stream error event `{"error": {...}}` (vLLM's shape) and `[DONE]`. `garbage_after_tokens`:
    after N token chunks a `data:` line that is not JSON. `hold_after_tokens`: after N token chunks the
    stream waits until `release()`; `held` is set while it waits (an event a test can wait on), and
    `aborted` if the client hangs up meanwhile (the body then ends: how vLLM stops generating)."""

    token_delay_s: float = 0.0
    drop_after_tokens: int | None = None
    error_after_tokens: int | None = None
    garbage_after_tokens: int | None = None
    hold_after_tokens: int | None = None
    held: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    aborted: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class DroppedConnection(Exception):
    """Raised inside the ASGI app mid-body: the server closes the connection without ending the body."""


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _segments(message: dict[str, Any], calls: list[tuple[str, str]]) -> list[tuple[int, int, Field]]:
    """Byte ranges of the assistant turn's text (as `assistant_text` writes it) and the field each is in."""
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    content = message.get("content")
    out: list[tuple[int, int, Field]] = []
    pos = 0

    def add(text: str, what: Field) -> None:
        nonlocal pos
        n = len(text.encode())
        out.append((pos, pos + n, what))
        pos += n

    if reasoning:
        add("<think>\n", "")
        add(reasoning, "reasoning")
        add("\n</think>\n\n", "")
    if content:
        add(content, "content")
    for j, (name, arguments) in enumerate(calls):
        add(
            ("\n" if j or content else "") + '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ',
            "",
        )
        add(arguments, ("args", j))
        add("}\n</tool_call>", "")
    return out


def token_deltas(
    tok: FakeTokenizer, ids: list[int], message: dict[str, Any], calls: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The delta of each sampled token: the text it completes in each field (empty for markup)."""
    pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    segments = _segments(message, pairs)
    decoders: dict[Field, Any] = {}
    started: set[int] = set()
    deltas: list[dict[str, Any]] = []
    pos = 0
    for i in ids:
        raw = tok.token_bytes(i)
        lo, hi = pos, pos + len(raw)
        pos = hi
        delta: dict[str, Any] = {}
        for s0, s1, what in segments:
            if not what or s1 <= lo or s0 >= hi:
                continue
            piece = raw[max(s0, lo) - lo : min(s1, hi) - lo]
            dec = decoders.setdefault(what, codecs.getincrementaldecoder("utf-8")())
            text = dec.decode(piece)
            if isinstance(what, tuple):
                j = what[1]
                call: dict[str, Any] = {"index": j, "function": {"arguments": text}}
                if j not in started:
                    started.add(j)
                    call = {
                        "index": j,
                        "id": calls[j]["id"],
                        "type": "function",
                        "function": {"name": calls[j]["function"]["name"], "arguments": text},
                    }
                delta.setdefault("tool_calls", []).append(call)
            elif text:
                delta[what] = delta.get(what, "") + text
        deltas.append(delta)
    return deltas


class StreamWriter:
    """The chunks of one streamed answer, cut from the whole body the fake would have sent."""

    def __init__(
        self,
        kind: str,
        body: dict[str, Any],
        sampled_ids: list[int],
        request: dict[str, Any],
        tok: FakeTokenizer,
    ) -> None:
        self.kind = kind
        self.body = body
        self.ids = sampled_ids
        self.request = request
        self.tok = tok

    def chunks(self) -> tuple[bytes, list[bytes], list[bytes]]:
        """(first chunk, one chunk per token, the closing bytes: usage chunk and [DONE])."""
        b = self.body
        head = {
            "id": b["id"],
            "object": "chat.completion.chunk",
            "created": b["created"],
            "model": b["model"],
        }
        choice = b["choices"][0]
        message = choice["message"]
        first: dict[str, Any] = {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if b.get("prompt_token_ids") is not None:
            first["prompt_token_ids"] = b["prompt_token_ids"]
        if self.kind == "vllm" and b.get("policy_version") is not None:
            first["policy_version"] = b["policy_version"]
        deltas = token_deltas(self.tok, self.ids, message, message.get("tool_calls") or [])
        if self.kind == "openai":  # OpenAI-compatible servers name reasoning `reasoning_content`
            for d in deltas:
                if "reasoning" in d:
                    d["reasoning_content"] = d.pop("reasoning")
        body_ids = choice.get("token_ids")
        entries = (choice.get("logprobs") or {}).get("content")
        n = len(deltas)
        out: list[bytes] = []
        for k, delta in enumerate(deltas):
            last = k == n - 1
            c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            if entries is not None:
                c["logprobs"] = {"content": entries[k:] if last else entries[k : k + 1]}
            if body_ids is not None:
                c["token_ids"] = body_ids[k:] if last else body_ids[k : k + 1]
            if last:
                c["finish_reason"] = choice["finish_reason"]
                c["stop_reason"] = choice.get("stop_reason")
            chunk: dict[str, Any] = {**head, "choices": [c]}
            if last and b.get("polar_flags"):
                c["polar_flags"] = chunk["polar_flags"] = b["polar_flags"]
            out.append(_sse(chunk))
        closing = b""
        opts = self.request.get("stream_options") or {}
        if opts.get("include_usage"):
            closing += _sse({**head, "choices": [], "usage": b["usage"]})
        return _sse(first), out, [closing + b"data: [DONE]\n\n"]


async def stream_body(
    writer: StreamWriter, faults: StreamFaults, receive: Callable[[], Awaitable[dict[str, Any]]]
) -> AsyncIterator[bytes]:
    """The SSE body, with the faults applied; raises `DroppedConnection` to drop the connection. While
    held, it watches `receive` (the ASGI request's) for the client hanging up."""
    first, tokens, closing = writer.chunks()
    yield first
    for k, chunk in enumerate(tokens):
        if faults.hold_after_tokens is not None and k == faults.hold_after_tokens:
            faults.held.set()
            while not faults.released.is_set():
                try:
                    message = await asyncio.wait_for(receive(), 0.01)
                except TimeoutError:
                    continue
                if message["type"] == "http.disconnect":
                    faults.aborted.set()
                    return
        if faults.drop_after_tokens is not None and k == faults.drop_after_tokens:
            raise DroppedConnection(f"fake: dropped the connection after {k} tokens")
        if faults.error_after_tokens is not None and k == faults.error_after_tokens:
            err = {
                "error": {
                    "message": f"fake: engine died after {k} tokens",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
            yield _sse(err) + b"data: [DONE]\n\n"
            return
        if faults.garbage_after_tokens is not None and k == faults.garbage_after_tokens:
            yield b"data: {this is not json\n\n"
            continue
        if faults.token_delay_s:
            await asyncio.sleep(faults.token_delay_s)
        yield chunk
    for c in closing:
        yield c
