"""The contract every dialect module fulfils.

A dialect is stateless: it parses a wire body into a `CanonicalRequest`, renders a `Completion` back (as one
JSON body, or as the complete list of SSE frames of its streaming grammar), and shapes errors. The proxy
owns everything stateful (sessions, upstream, capture).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, Protocol

from polar.gateway.canonical import CanonicalRequest, Completion
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec

# How a streamed answer is written: SSE frames, or (Gemini's `:streamGenerateContent` without `alt=sse`) one
# JSON array of the stream's chunks.
StreamFormat = Literal["sse", "json-array"]


class Dialect(Protocol):
    name: str

    def parse(
        self,
        body: Any,
        codec: ReasoningCodec,
        *,
        path_model: str | None = None,
        path_stream: bool | None = None,
    ) -> CanonicalRequest:
        """Validate `body` (already JSON-decoded) and normalize it; raise `GatewayError` naming the field.

        `path_model`/`path_stream` come from the URL for dialects that put them there (Gemini).
        """
        ...

    def render(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> dict[str, Any]:
        """The non-streaming response body, with the model name the harness asked for."""
        ...

    def stream(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> Iterator[bytes]:
        """The SSE frames (each ending in a blank line) of the dialect's streaming grammar."""
        ...

    def stream_json(
        self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec
    ) -> list[dict[str, Any]]:
        """The stream as one JSON array of its chunks, for dialects that have that form (Gemini without
        `alt=sse`); `SSEOnly` is the implementation of those that do not."""
        ...

    def error(self, err: GatewayError) -> tuple[int, dict[str, Any]]:
        """HTTP status and the dialect's error envelope."""
        ...

    def stream_error(self, err: GatewayError) -> bytes:
        """The in-stream error event(s) of the dialect, as SSE bytes."""
        ...

    def stream_error_status(self, err: GatewayError) -> int:
        """The HTTP status of a stream that carries only `stream_error(err)`: 200 where the dialect's SDKs
        raise on the in-stream event, the error's own status where some SDK only raises on that."""
        ...


class SSEOnly:
    """For dialects whose only stream grammar is SSE: no route asks them for a JSON-array stream."""

    name: str

    def stream_json(
        self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec
    ) -> list[dict[str, Any]]:
        raise GatewayError("invalid_request", f"the {self.name} dialect streams only as server-sent events")


def sse(data: bytes, event: str | None = None) -> bytes:
    """One SSE frame. `data` must be a single line (orjson output is)."""
    if event is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
