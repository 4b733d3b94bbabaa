"""A lean HTTP/1.1 client for the gateway's JSON calls to its own inference server.

aiohttp's client cost the gateway 0.06-0.10 ms of CPU a call more than this one (bench/gateway_floor.py
--mixes, docs/benchmarks.md), a sixth of everything the gateway does per call: it builds a request object,
a response object, header multidicts, a stream reader and a task-level timeout for each call. Here a call
is one `write` of the request's bytes on a kept-alive connection and one future resolved by httptools'
response parser (the parser uvicorn uses) when the answer's last byte has arrived; chunked answers are
decoded by the parser.

It serves `UpstreamClient`'s non-streamed requests to an `http://` server the operator configured (no
outbound policy to apply per connection: task-named URLs and `https://` stay on aiohttp, as do streams).
What it does not do, because vLLM, SGLang and polar's engine never need it there: TLS, redirects,
compression, proxies, answers delimited by closing the connection (one ends as `Dropped`), pipelining.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools

# vLLM and SGLang serve through uvicorn, which closes a keep-alive connection idle for 5 s: letting go first
# avoids sending on one the server is closing (aiohttp's `keepalive_timeout` was set the same).
KEEPALIVE_S = 4.0


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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always a subclass of asyncio's: uvloop's (Ray's actors run on
        # uvloop) is its own class with the same methods.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(Dropped(str(exc) if exc else "the server closed the connection"))

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: the connection's state is unknown
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Malformed(str(exc)))
            self.close()

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        self.reusable = self.parser.should_keep_alive()
        waiter, self.waiter = self.waiter, None
        body, self.parts = b"".join(self.parts), []
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), body))

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


class H1Pool:
    """Kept-alive connections to one `http://host:port` origin, at most `max_connections` in use."""

    def __init__(
        self, base_url: str, headers: dict[str, str], max_connections: int, connect_timeout_s: float
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"H1Pool serves http://host[:port] only, not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        fixed = {
            "Host": parts.netloc.rpartition("@")[2],
            **headers,
        }  # as written: [::1]:8000 keeps its brackets
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self.max_connections = max_connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._idle: deque[_Conn] = deque()
        self._all: set[_Conn] = set()

    async def request(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """(status, body) of one request; Unreachable, Dropped, Malformed, or the caller's timeout."""
        if asyncio.get_running_loop() is not self._loop:
            self._bind()
        if self._slots is None:
            return await self._request(method, path, body)
        async with self._slots:
            return await self._request(method, path, body)

    async def _request(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        conn = self._idle_conn() or await self._connect()
        data = b"%s %s HTTP/1.1\r\n" % (method.encode(), (self.prefix + path).encode())
        data += self._head
        if body is not None:
            data += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        else:
            data += b"\r\n"
        try:
            answer = await conn.send(data)
        except BaseException:  # dropped, malformed, or cancelled mid-answer: never reused
            conn.close()
            self._all.discard(conn)
            raise
        if conn.reusable and not conn.closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
            self._all.discard(conn)
        return answer

    def _bind(self) -> None:
        """Start over on the running loop: a connection belongs to the loop that made it, and a client used
        from a second loop (a check before a server starts, say) must not reuse the first one's."""
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self.max_connections) if self.max_connections > 0 else None
        self._idle.clear()
        self._all.clear()

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
