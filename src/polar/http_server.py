"""uvicorn's HTTP protocols, answering malformed HTTP with a JSON error instead of plain text.

uvicorn (h11 and httptools alike) answers a request it cannot parse — a bad request line or header, or the
bytes after a body shorter than its `Content-Length`, read as the next request — with a `text/plain` 400
"Invalid HTTP request received.". Every client of a polar server reads errors as JSON: the SDKs behind the
harnesses and polar's own clients would fail on the body instead of reporting the error. Every uvicorn that
polar starts uses `http_protocol()` (`uvicorn.Config(http=...)` takes a protocol class).
"""

from __future__ import annotations

import asyncio

import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

HINT = (
    "The request line, headers or framing could not be parsed (for example, bytes past the body's "
    "Content-Length are read as a next request)."
)


def error_body(message: str) -> bytes:
    """One envelope that every polar client reads: OpenAI's `error.message/type/param`, Anthropic's
    top-level `type: error`, Gemini's `error.status`, the rollout server's `error.message/type/param`."""
    error = {"message": f"{message} {HINT}", "type": "invalid_request_error", "param": None}
    return orjson.dumps({"type": "error", "error": {**error, "status": "INVALID_ARGUMENT"}})


def _response(body: bytes, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    head = [b"HTTP/1.1 400 Bad Request\r\n"]
    head.extend(name + b": " + value + b"\r\n" for name, value in default_headers)
    head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
    head.append(b"connection: close\r\n\r\n")
    return b"".join(head) + body


class JSONErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        # The connection is unusable past a parse error, and h11's state machine may be mid-response
        # (pipelining): write the answer as raw bytes, as uvicorn's httptools protocol does, then close.
        if not self.transport.is_closing():
            self.transport.write(_response(error_body(msg), self.server_state.default_headers))
        self.transport.close()


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is optional in uvicorn; h11 is always there
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

if HttpToolsProtocol is not None:

    class JSONErrorHttpToolsProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            if not self.transport.is_closing():
                self.transport.write(_response(error_body(msg), self.server_state.default_headers))
            self.transport.close()


def http_protocol() -> type[asyncio.Protocol]:
    """What uvicorn's `http="auto"` picks (httptools when installed, else h11), with JSON errors."""
    if HttpToolsProtocol is not None:
        return JSONErrorHttpToolsProtocol
    return JSONErrorH11Protocol
