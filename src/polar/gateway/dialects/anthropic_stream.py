"""Anthropic's SSE grammar, written incrementally.

`MessageStream` emits `message_start`, then per content block `content_block_start` / `..._delta` /
`content_block_stop`, then `message_delta` and `message_stop`. It is fed pieces (a thinking delta, a text
delta, the start of a tool call, a piece of its JSON input) and opens and closes blocks itself, so a
synthesized stream (one piece per block, from a finished completion) and a real token-by-token stream use
the same writer.
"""

from __future__ import annotations

from typing import Any

import orjson

from polar.gateway.dialects.base import sse

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
