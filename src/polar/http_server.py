"""uvicorn's HTTP protocols, answering malformed HTTP with a JSON error instead of plain text.

uvicorn (h11 and httptools alike) answers a request it cannot parse — a bad request line or header, or the
bytes after a body shorter than its `Content-Length`, read as the next request — with a `text/plain` 400
"Invalid HTTP request received.". Every client of a polar server reads errors as JSON: the SDKs behind the
harnesses and polar's own clients would fail on the body instead of reporting the error. Every uvicorn that
polar starts uses `http_protocol()` (`uvicorn.Config(http=...)` takes a protocol class).

The httptools protocol also writes through `CorkedTransport`: what an answer writes in one pass of the event
loop goes out in one `send`. A streamed answer writes a piece per upstream event; when several arrived in
one read (vLLM under load, a fast server), they were as many syscalls, which were the largest single cost
of a streamed call (bench/gateway_cpu.py --path chat-stream, docs/benchmarks.md).

They also read at most `READ_SIZE` at a time (`small_reads`): asyncio's socket transport reads with
`sock.recv(256 KiB)`, and CPython allocates that much for every read, a size glibc serves with mmap and
munmap, before shrinking it to what came.

The same protocols close a connection whose request headers are not complete within `header_timeout_s`.
uvicorn times out only an idle keep-alive connection (and stops that timer at the first byte of the next
request): a client that sends half a request line and then nothing held its connection, and a descriptor,
forever. One sandboxed agent held 587 that way and took its node's model API down for every session.
"""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Any, cast

import h11
import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT_S = 30.0
HEADER_TIMEOUT_ENV = "POLAR_HEADER_TIMEOUT_S"  # an operator's (or a test's) override, in seconds

# Bytes a `CorkedTransport` holds before it sends them without waiting for the loop's next pass.
CORK_LIMIT = 64 * 1024
# The most one read of a socket takes (`small_reads`).
READ_SIZE = 64 * 1024

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


def header_timeout() -> float:
    """`POLAR_HEADER_TIMEOUT_S` when set to a positive number, else `DEFAULT_HEADER_TIMEOUT_S`."""
    try:
        value = float(os.environ.get(HEADER_TIMEOUT_ENV, ""))
    except ValueError:
        return DEFAULT_HEADER_TIMEOUT_S
    return value if value > 0 else DEFAULT_HEADER_TIMEOUT_S


class _HeaderDeadline:
    """A timer from the moment a connection waits for a request until that request's headers are complete;
    when it fires the connection is closed (nothing is answered: the client never finished asking).

    Mixed into uvicorn's protocols, which provide `loop`, `transport` and `cycle`."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    _header_timer: asyncio.TimerHandle | None = None

    def _await_headers(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_done(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A request is still being answered and the late headers are a pipelined next one: the answer
            # goes on (a stream may take minutes); the next one is looked at again later.
            self._await_headers()
            return
        self.transport.close()


def small_reads(transport: asyncio.BaseTransport) -> None:
    """Have `transport` read at most `READ_SIZE` at a time, if it is asyncio's socket transport.

    CPython 3.11's `_SelectorSocketTransport` reads with `sock.recv(max_size)`, 256 KiB: the bytes object is
    allocated at that size and shrunk to what arrived, and glibc serves 256 KiB with mmap and munmap (past its
    128 KiB mmap threshold, where polar.memory also fixes it so memory is given back). Measured here, a 7 kB request
    sent and read took 19.1 us against 4.0 us at 64 KiB, 60 kB 46.5 against 8.9 us (bench/socket_reads.py);
    a call reads at least twice (the request, the upstream answer) and a stream once per upstream event.
    uvloop's transport reads into a buffer of its own and has no `max_size`: left as it is."""
    if hasattr(transport, "max_size"):
        transport.max_size = READ_SIZE


class CorkedTransport:
    """A transport whose writes in one pass of the loop are sent together at the start of the next (one
    `call_soon` per pass), or at once when `CORK_LIMIT` bytes are held: a large answer written in one pass
    still reaches the wrapped transport, whose buffer limits pause its writer (uvicorn's flow control).
    Closing sends what is held first; aborting drops it, as an abort does. Anything else is the wrapped
    transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._held_bytes = 0

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self._send)
        self._held.append(data)
        self._held_bytes += len(data)
        if self._held_bytes >= CORK_LIMIT:
            self._send()

    def _send(self) -> None:
        held, self._held, self._held_bytes = self._held, [], 0
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self._send()
        self._transport.close()

    def abort(self) -> None:
        self._held, self._held_bytes = [], 0
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._held_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class JSONErrorH11Protocol(_HeaderDeadline, H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        small_reads(transport)
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # h11 reports the peer IDLE until a request's headers are complete (SEND_BODY or DONE after).
        if self.conn.their_state is h11.IDLE:
            self._await_headers()
        else:
            self._headers_done()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        super().connection_lost(exc)

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

    class JSONErrorHttpToolsProtocol(_HeaderDeadline, HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            small_reads(transport)
            corked = cast(asyncio.Transport, CorkedTransport(transport, asyncio.get_running_loop()))
            super().connection_made(corked)
            self._await_headers()

        def on_message_begin(self) -> None:  # the first byte of a request (a keep-alive connection's next)
            super().on_message_begin()
            self._await_headers()

        def on_headers_complete(self) -> None:
            self._headers_done()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            if not self.transport.is_closing():
                self.transport.write(_response(error_body(msg), self.server_state.default_headers))
            self.transport.close()


@functools.cache
def _with_timeout(header_timeout_s: float) -> type[asyncio.Protocol]:
    base: type[asyncio.Protocol] = (
        JSONErrorHttpToolsProtocol if HttpToolsProtocol is not None else JSONErrorH11Protocol
    )
    return type(base.__name__, (base,), {"header_timeout_s": header_timeout_s})


def http_protocol(header_timeout_s: float | None = None) -> type[asyncio.Protocol]:
    """What uvicorn's `http="auto"` picks (httptools when installed, else h11), with JSON errors and a
    deadline for request headers (`header_timeout()` when not given)."""
    return _with_timeout(header_timeout_s if header_timeout_s is not None else header_timeout())
