"""A lean HTTP/1.1 client for the gateway's JSON calls to its own inference server.

aiohttp's client cost the gateway 0.06-0.10 ms of CPU a call more than this one (bench/gateway_floor.py
--mixes, docs/benchmarks.md), a sixth of everything the gateway does per call: it builds a request object,
a response object, header multidicts, a stream reader and a task-level timeout for each call. Here a call
is one `write` of the request's bytes on a kept-alive connection and one future resolved by httptools'
response parser (the parser uvicorn uses) when the answer's last byte has arrived; chunked answers are
decoded by the parser.

A stream (`H1Pool.open_stream`) hands its body on as it arrives: whatever has come in since the last read
in one piece, the socket's reading paused while more than `STREAM_BUFFER` bytes wait for the reader, and
one deadline for the whole answer instead of a timeout around each read (a 24-token stream is 26 reads;
aiohttp spent several objects on each). No call has a timer of its own: one sweep every `SWEEP_S` fails
the answers in flight, streamed or not, whose deadline has passed.

It serves `UpstreamClient`'s requests to an `http://` server the operator configured (no outbound policy to
apply per connection: task-named URLs and `https://` stay on aiohttp). What it does not do, because vLLM,
SGLang and polar's engine never need it there: TLS, redirects, compression, proxies, pipelining. An answer
delimited by closing the connection (an HTTP/1.0 server's) ends at that close.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools

from polar.http_server import small_reads

# vLLM and SGLang serve through uvicorn, which closes a keep-alive connection idle for 5 s: letting go first
# avoids sending on one the server is closing (aiohttp's `keepalive_timeout` was set the same).
KEEPALIVE_S = 4.0
# How often the deadlines of the calls in flight are checked: a call times out at most this late.
SWEEP_S = 0.05
# Bytes of a streamed body that may wait for the reader before the socket's reading is paused.
STREAM_BUFFER = 1 << 20


class Unreachable(Exception):
    """No connection could be made (refused, no route): the server saw nothing."""


class Dropped(Exception):
    """The connection closed before the whole answer arrived: nothing usable came back."""


class Malformed(Exception):
    """The server's bytes are not an HTTP/1.1 answer."""


class _Conn(asyncio.Protocol):
    """One connection: at most one request in flight, its answer delivered to `waiter`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.parts: list[bytes] = []
        self.closed = False
        self.reusable = False
        self.idle_since = 0.0
        self.stream: Stream | None = None  # set while a streamed answer is read
        self.in_body = False  # the answer's head is parsed, its end not yet
        self.framed = False  # the answer says where its body ends (content-length or chunked)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always a subclass of asyncio's: uvloop's (Ray's actors run on
        # uvloop) is its own class with the same methods.
        small_reads(transport)
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is None and self.in_body and not self.framed:
            # An answer with neither a length nor chunks ends where its server closes the connection
            # (RFC 9112 section 6.3, last rule: HTTP/1.0 servers, Python's http.server). httptools has no
            # way to be told of that end (llhttp_finish is not exposed), so it is this close.
            self.on_message_complete()
            if self.stream is not None:
                self.stream.wake()
            return
        self._fail(Dropped(str(exc) if exc else "the server closed the connection"))

    def data_received(self, data: bytes) -> None:
        if self.waiter is None and self.stream is None:  # bytes nobody asked for: the state is unknown
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Malformed(str(exc)))
            self.close()
        if self.stream is not None:
            self.stream.wake()

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True
        elif self.stream is not None and name == b"content-type":
            self.stream.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")

    def on_headers_complete(self) -> None:
        self.in_body = True
        if self.stream is not None:
            self._resolve((self.parser.get_status_code(), b""))

    def on_body(self, body: bytes) -> None:
        if self.stream is not None:
            self.stream.arrived(body)
        else:
            self.parts.append(body)

    def on_message_complete(self) -> None:
        self.in_body = self.framed = False
        self.reusable = self.parser.should_keep_alive()
        if self.stream is not None:
            self.stream.ended = True
            return
        body, self.parts = b"".join(self.parts), []
        self._resolve((self.parser.get_status_code(), body))

    def _resolve(self, answer: tuple[int, bytes]) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def send(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.waiter = self.loop.create_future()
        self.reusable = False
        self.transport.write(data)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.loop.is_closed():  # else its socket goes with it
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.stream is not None:
            self.stream.failed(exc)


class Stream:
    """A streamed answer on one connection, from its head on: `status`, `content_type` (its media type,
    lower case, without parameters), then `read()` until it returns `b""`. Exactly one of `release()` (the
    whole body read: the connection may serve again) or `close()` (abandoned: the connection is closed,
    which is how vLLM and SGLang learn to abort a generation) ends it; both give its pool slot back."""

    def __init__(self, pool: H1Pool, conn: _Conn, slot: asyncio.Semaphore | None) -> None:
        self.pool, self.conn, self._slot = pool, conn, slot
        self.status = 0
        self.content_type = "application/octet-stream"  # when the answer names none, as aiohttp says
        self.ended = False
        self._pieces: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._error: Exception | None = None
        self._more: asyncio.Future[None] | None = None
        self._finished = False

    # -- called by the connection as its bytes are parsed ---------------------------------------------
    def arrived(self, piece: bytes) -> None:
        self._pieces.append(piece)
        self._buffered += len(piece)
        if self._buffered > STREAM_BUFFER and not self._paused and self.conn.transport is not None:
            self._paused = True
            self.conn.transport.pause_reading()

    def failed(self, exc: Exception) -> None:
        if self._error is None and not self.ended:
            self._error = exc
        self.wake()

    def wake(self) -> None:
        more, self._more = self._more, None
        if more is not None and not more.done():
            more.set_result(None)

    # -- the reader --------------------------------------------------------------------------------------
    async def read(self) -> bytes:
        """All the body that has arrived since the last read (waiting for some), `b""` at its end."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self.ended:
                return b""
            self._more = self.conn.loop.create_future()
            await self._more
        piece = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
        self._pieces.clear()
        self._buffered = 0
        if self._paused and self.conn.transport is not None:
            self._paused = False
            self.conn.transport.resume_reading()
        return piece

    def release(self) -> None:
        self._finish(reuse=self.ended and not self._pieces)

    def close(self) -> None:
        self._finish(reuse=False)

    def _finish(self, reuse: bool) -> None:
        if self._finished:
            return
        self._finished = True
        self.pool._deadlines.pop(self.conn, None)
        self.conn.stream = None
        self.pool._done(self.conn, reuse)
        if self._slot is not None:
            self._slot.release()


class H1Pool:
    """Kept-alive connections to one `http://host:port` origin, at most `max_connections` in use."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        max_connections: int,
        connect_timeout_s: float,
        stream_headers: dict[str, str] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"H1Pool serves http://host[:port] only, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        host = parts.netloc.rpartition("@")[2]  # as written: [::1]:8000 keeps its brackets
        self._head = _head({"Host": host, **headers})
        self._stream_head = _head({"Host": host, **headers, **(stream_headers or {})})
        self.max_connections = max_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._idle: deque[_Conn] = deque()
        self._all: set[_Conn] = set()
        self._deadlines: dict[_Conn, float] = {}  # the calls in flight that have one
        self._sweeper: asyncio.TimerHandle | None = None

    async def request(
        self, method: str, path: str, body: bytes | None, deadline: float | None = None
    ) -> tuple[int, bytes]:
        """(status, body) of one request; Unreachable, Dropped, Malformed, or TimeoutError once the loop's
        clock passes `deadline` (checked every `SWEEP_S`: one sweep for all calls in flight instead of a
        timer per call, which cost ~3 % of the gateway's CPU a call)."""
        slot = await self._acquire(deadline)
        try:
            return await self._request(method, path, body, deadline)
        finally:
            if slot is not None:
                slot.release()

    async def _request(
        self, method: str, path: str, body: bytes | None, deadline: float | None
    ) -> tuple[int, bytes]:
        conn = self._idle_conn() or await self._connect()
        if deadline is not None:
            self._watch(conn, deadline)
        try:
            answer = await conn.send(self._message(method, path, self._head, body))
        except BaseException:  # dropped, malformed, timed out or cancelled mid-answer: never reused
            self._done(conn, reuse=False)
            raise
        finally:
            if deadline is not None:
                self._deadlines.pop(conn, None)
        self._done(conn, reuse=True)
        return answer

    async def _acquire(self, deadline: float | None) -> asyncio.Semaphore | None:
        """Bound to the running loop, a connection slot taken (the semaphore to give it back to, None when
        unlimited); waiting for one ends with TimeoutError at `deadline`."""
        if asyncio.get_running_loop() is not self._loop:
            self._bind()
        slot = self._slots
        if slot is not None:
            if slot.locked() and deadline is not None:
                async with asyncio.timeout_at(deadline):
                    await slot.acquire()
            else:
                await slot.acquire()
        return slot

    def _watch(self, conn: _Conn, deadline: float) -> None:
        """Fail `conn`'s answer at `deadline` (until it leaves `_deadlines`), by the next sweep."""
        self._deadlines[conn] = deadline
        if self._sweeper is None:
            self._sweeper = conn.loop.call_later(SWEEP_S, self._sweep, conn.loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fail the calls whose deadline has passed (their connections closed); again while any remain."""
        if loop is not self._loop:  # armed before the pool moved to another loop: not this one's calls
            return
        self._sweeper = None
        now = loop.time()
        for conn, deadline in list(self._deadlines.items()):
            if deadline <= now:
                del self._deadlines[conn]
                conn._fail(TimeoutError("the answer did not come before its deadline"))
                conn.close()
        if self._deadlines:
            self._sweeper = loop.call_later(SWEEP_S, self._sweep, loop)

    async def open_stream(self, path: str, body: bytes, deadline: float) -> Stream:
        """A POST whose answer is read as it arrives, once its head is in: the `Stream` holds a connection
        slot until it is released or closed. `deadline` (the loop's clock) bounds the whole answer, its
        head included: past it a read raises TimeoutError and the connection is closed."""
        slot = await self._acquire(deadline)
        try:
            conn = self._idle_conn() or await self._connect()
        except BaseException:
            if slot is not None:
                slot.release()
            raise
        stream = conn.stream = Stream(self, conn, slot)
        self._watch(conn, deadline)
        try:
            stream.status, _ = await conn.send(self._message("POST", path, self._stream_head, body))
        except BaseException:
            stream.close()
            raise
        return stream

    def _message(self, method: str, path: str, head: bytes, body: bytes | None) -> bytes:
        data = b"%s %s HTTP/1.1\r\n" % (method.encode(), (self.prefix + path).encode()) + head
        if body is not None:
            return data + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        return data + b"\r\n"

    def _done(self, conn: _Conn, reuse: bool) -> None:
        """A connection's answer is over: back to the idle ones if it may serve again, else closed."""
        if reuse and conn.reusable and not conn.closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
            self._all.discard(conn)

    def _bind(self) -> None:
        """Start over on the running loop: a connection belongs to the loop that made it, and a client used
        from a second loop (a check before a server starts, say) must not reuse the first one's."""
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self.max_connections) if self.max_connections > 0 else None
        self._idle.clear()
        self._all.clear()
        self._deadlines.clear()
        self._sweeper = None

    def _idle_conn(self) -> _Conn | None:
        """The most recently used idle connection still open and fresh; stale ones are closed."""
        deadline = time.monotonic() - KEEPALIVE_S
        while self._idle and (self._idle[0].closed or self._idle[0].idle_since < deadline):
            stale = self._idle.popleft()
            stale.close()
            self._all.discard(stale)
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
            self._all.discard(conn)
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Conn(loop), self.host, self.port)
        except OSError as exc:
            raise Unreachable(str(exc)) from None
        self._all.add(conn)
        return conn

    async def aclose(self) -> None:
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._idle.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


def _head(headers: dict[str, str]) -> bytes:
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
