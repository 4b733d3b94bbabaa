"""Anthropic's SSE grammar, written incrementally.

`MessageStream` emits `message_start`, then per content block `content_block_start` / `..._delta` /
`content_block_stop`, then `message_delta` and `message_stop`. It is fed pieces (a thinking delta, a text
delta, the start of a tool call, a piece of its JSON input) and opens and closes blocks itself, so a
synthesized stream (one piece per block, from a finished completion) and a real token-by-token stream
(`AnthropicStreamEncoder`) use the same writer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk, StreamHead
from polar.gateway.dialects.base import sse
from polar.gateway.dialects.wire import tool_input_json
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec

_PING = sse(b'{"type":"ping"}', "ping")
_STOP = sse(b'{"type":"message_stop"}', "message_stop")


def _frame(event: str, payload: dict[str, Any]) -> bytes:
    return sse(orjson.dumps(payload), event)


class MessageStream:
    """Writer of one streamed Message; every method returns the SSE bytes to send next."""

    __slots__ = ("_index", "_open")

    def __init__(self) -> None:
        self._index = -1
        self._open: str | None = None  # type of the block being written, None between blocks

    def start(self, message_id: str, model: str, input_tokens: int) -> bytes:
        message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        return _frame("message_start", {"type": "message_start", "message": message}) + _PING

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = kind
        payload = {"type": "content_block_start", "index": self._index, "content_block": block}
        return out + _frame("content_block_start", payload)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        payload = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return _frame("content_block_delta", payload)

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _frame("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def thinking(self, text: str) -> bytes:
        """A piece of thinking text (opens a thinking block if none is open)."""
        out = (
            b""
            if self._open == "thinking"
            else self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        )
        if not text:
            return out
        return out + self._delta({"type": "thinking_delta", "thinking": text})

    def signature(self, signature: str) -> bytes:
        """The signature of the open thinking block; Anthropic sends it just before the block stops."""
        out = b"" if self._open == "thinking" else self.thinking("")
        return out + self._delta({"type": "signature_delta", "signature": signature})

    def text(self, text: str) -> bytes:
        """A piece of answer text (opens a text block if none is open)."""
        out = b"" if self._open == "text" else self._begin("text", {"type": "text", "text": ""})
        if not text:
            return out
        return out + self._delta({"type": "text_delta", "text": text})

    def tool_use(self, call_id: str, name: str) -> bytes:
        """Starts a tool_use block; its input follows as `tool_input` pieces."""
        return self._begin("tool_use", {"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def tool_input(self, partial_json: str) -> bytes:
        return self._delta({"type": "input_json_delta", "partial_json": partial_json})

    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> bytes:
        """Closes the open block and the message."""
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens},
        }
        return self._close() + _frame("message_delta", delta) + _STOP


class AnthropicStreamEncoder:
    """An Anthropic Messages stream as it is sampled (a `StreamEncoder`).

    - thinking pieces as they come (none when the request disabled thinking, empty when it asked for them
      to be omitted); the block's `signature_delta` when the block ends, since it signs the whole reasoning;
    - text pieces as they come;
    - a tool call's `input_json_delta` pieces as they come when the model's arguments start as a JSON
      object. Arguments that do not (rare: the model wrote something else) are held back until the call is
      complete and sent whole in the `{"_polar_raw_arguments": text}` form the non-streamed answer uses
      (an Anthropic `input` must be an object; `wire.tool_input_json`). Arguments that start as an object but
      do not end as one (cut off by max_tokens, malformed) reach the harness as written, as Anthropic's own
      API streams a cut-off call; the record is flagged `tool_call_parse_error` as for a whole answer;
    - `close`: the stop reason (known only at the end) and the output token count.
    """

    def __init__(
        self,
        req: CanonicalRequest,
        codec: ReasoningCodec,
        *,
        message_id: Callable[[str], str],
        stop_reason: Callable[[Completion], str],
        error: Callable[[GatewayError], bytes],
    ) -> None:
        self._req = req
        self._codec = codec
        self._message_id = message_id
        self._stop_reason = stop_reason
        self._error = error
        self._w = MessageStream()
        self._show_thinking = req.render.get("thinking") is not False
        self._omit_thinking = bool(req.render.get("thinking_omitted"))
        self._thinking: list[str] | None = None  # the open thinking block's text
        self._tool = -1  # index of the open tool_use block
        self._args: list[str] = []
        self._streaming_args: bool | None = None  # None: not decided yet (only whitespace so far)

    def open(self, head: StreamHead) -> bytes:
        return self._w.start(self._message_id(head.id), self._req.model, head.prompt_tokens)

    def delta(self, chunk: StreamChunk) -> bytes:
        out = b""
        w = self._w
        if chunk.reasoning and self._show_thinking:
            out += self._end_tool()
            if self._thinking is None:
                self._thinking = []
                out += w.thinking("")
            self._thinking.append(chunk.reasoning)
            if not self._omit_thinking:
                out += w.thinking(chunk.reasoning)
        if chunk.content:
            out += self._end_thinking() + self._end_tool() + w.text(chunk.content)
        for tc in chunk.tool_calls:
            if tc.index != self._tool:
                out += self._end_thinking() + self._end_tool() + w.tool_use(tc.call_id, tc.name or "")
                self._tool, self._args, self._streaming_args = tc.index, [], None
            if not tc.arguments:
                continue
            self._args.append(tc.arguments)
            if self._streaming_args is None:
                text = "".join(self._args)
                start = text.lstrip()
                if start:
                    self._streaming_args = start[0] == "{"
                    if self._streaming_args:
                        out += w.tool_input(text)
            elif self._streaming_args:
                out += w.tool_input(tc.arguments)
        return out

    def _end_thinking(self) -> bytes:
        if self._thinking is None:
            return b""
        text, self._thinking = "".join(self._thinking), None
        return self._w.signature(self._codec.encode(text))

    def _end_tool(self) -> bytes:
        if self._tool < 0:
            return b""
        held = not self._streaming_args
        self._tool = -1
        return self._w.tool_input(tool_input_json("".join(self._args))) if held else b""

    def close(self, comp: Completion) -> bytes:
        out = self._end_thinking() + self._end_tool()
        return out + self._w.finish(self._stop_reason(comp), None, comp.completion_tokens)

    def fail(self, err: GatewayError) -> bytes:
        return self._error(err)
