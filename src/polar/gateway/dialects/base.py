"""The contract every dialect module fulfils.

A dialect is stateless: it parses a wire body into a `CanonicalRequest`, renders a `Completion` back (as one
JSON body, or as the complete list of SSE frames of its streaming grammar), and shapes errors. A streamed
answer is written as it is sampled by a `StreamEncoder`, the one stateful piece a dialect hands out (one per
call). The proxy owns everything else that is stateful (sessions, upstream, capture).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, Protocol

from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk, StreamHead
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec
from polar.jsontypes import JSON

# How a streamed answer is written: SSE frames, or (Gemini's `:streamGenerateContent` without `alt=sse`) one
# JSON array of the stream's chunks.
StreamFormat = Literal["sse", "json-array"]


class StreamEncoder(Protocol):
    """Writes one answer in a dialect's streaming grammar while the upstream samples it.

    One encoder per call. The proxy calls, in this order:
    - `open(head)` once, when the first upstream chunk has arrived: the opening events (or b"");
    - `delta(chunk)` for every upstream chunk, in order: the events for its reasoning, text and tool-call
      pieces (b"" for a chunk that carries none, such as vLLM's first and its usage chunk);
    - then exactly one of `close(comp)`, with the finished `Completion` once its record is committed: the
      closing events (finish reason, usage, the final object); or `fail(err)`, at any point after `open`:
      the dialect's in-stream error event, which ends the stream.
    Each returns the bytes to send next. What cannot be written before the whole of something is known is
    held back by the encoder and written when it is (each encoder's docstring says what, and why).
    """

    def open(self, head: StreamHead) -> bytes: ...

    def delta(self, chunk: StreamChunk) -> bytes: ...

    def close(self, comp: Completion) -> bytes: ...

    def fail(self, err: GatewayError) -> bytes: ...


class Dialect(Protocol):
    name: str

    def parse(
        self,
        body: JSON,
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

    def stream_encoder(
        self, req: CanonicalRequest, codec: ReasoningCodec, fmt: StreamFormat
    ) -> StreamEncoder:
        """A fresh encoder for one streamed answer to `req`, in stream format `fmt` (see `StreamFormat`)."""
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

    def _sse_only(self, fmt: StreamFormat) -> None:
        if fmt != "sse":
            raise GatewayError(
                "invalid_request", f"the {self.name} dialect streams only as server-sent events"
            )

    def stream_json(
        self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec
    ) -> list[dict[str, Any]]:
        raise GatewayError("invalid_request", f"the {self.name} dialect streams only as server-sent events")


def sse(data: bytes, event: str | None = None) -> bytes:
    """One SSE frame. `data` must be a single line (orjson output is)."""
    if event is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
