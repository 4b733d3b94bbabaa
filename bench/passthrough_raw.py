"""The least a Python relay can cost: asyncio protocols with httptools' parsers on both sides, no framework,
no per-call task. A call is parsed as it arrives, its bytes sent upstream on a kept-alive connection from a
pool, and the answer written back in one `send` when the backend's last byte is parsed: callbacks only.

bench/gateway_floor.py measures it beside bench/passthrough.py (uvicorn + aiohttp, the gateway's libraries)
and `polar gateway`: how much of a call's CPU a lean HTTP server and client under the hot routes could save
(issue 30 point 1). It relays fixed-length bodies only (no chunked answers: the fake's JSON calls), one
request at a time per connection (no pipelining), and has no timeouts or limits: a measurement, not a server.

    .venv/bin/python bench/passthrough_raw.py --backend http://127.0.0.1:8000 --port 8101
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

Reply = Callable[[int, bytes], None]


class Upstream(asyncio.Protocol):
    """One kept-alive connection to the backend: one request in flight, its answer handed to `reply`."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.body: list[bytes] = []
        self.reply: Reply | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.lost(self)
        if self.reply is not None:
            self.reply(502, b'{"error": "upstream closed"}')

    def send(self, path: bytes, body: bytes, reply: Reply) -> None:
        assert self.transport is not None
        self.reply = reply
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        self.transport.write(head % (path, self.pool.host, len(body)) + body)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        reply, self.reply = self.reply, None
        body, self.body = b"".join(self.body), []
        status = self.parser.get_status_code()
        self.pool.idle.append(self)
        if reply is not None:
            reply(status, body)


class Pool:
    """Idle upstream connections; a call finding none opens one (the only awaited step, at warm-up)."""

    def __init__(self, backend: str) -> None:
        parts = urlsplit(backend)
        self.addr = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.host = f"{self.addr[0]}:{self.addr[1]}".encode()
        self.idle: list[Upstream] = []
        self.connecting: set[asyncio.Task[None]] = set()  # held until done: the loop keeps weak references

    def lost(self, conn: Upstream) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def send(self, path: bytes, body: bytes, reply: Reply) -> None:
        if self.idle:
            self.idle.pop().send(path, body, reply)
            return
        loop = asyncio.get_running_loop()

        async def connect() -> None:
            _, conn = await loop.create_connection(lambda: Upstream(self), *self.addr)
            conn.send(path, body, reply)

        task = loop.create_task(connect())
        self.connecting.add(task)
        task.add_done_callback(self.connecting.discard)


class Downstream(asyncio.Protocol):
    """One client connection: each complete request relayed through the pool, its answer written back."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path, self.url = self.url, b""
        body, self.body = b"".join(self.body), []
        if path == b"/health":
            self.answer(200, b"ok")
        else:
            self.pool.send(path, body, self.answer)

    def answer(self, status: int, body: bytes) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        head = b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        self.transport.write(head % (status, len(body)) + body)


async def serve(backend: str, port: int) -> None:
    pool = Pool(backend)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Downstream(pool), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    asyncio.run(serve(args.backend, args.port))


if __name__ == "__main__":
    main()
