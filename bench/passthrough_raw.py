"""The least a Python relay can cost: asyncio protocols with httptools' parsers on both sides, no framework,
no per-call task. A call is parsed as it arrives, its bytes sent upstream on a kept-alive connection from a
pool, and the answer written back in one `send` when the backend's last byte is parsed: callbacks only.

bench/gateway_floor.py measures it beside bench/passthrough.py (uvicorn + aiohttp, the gateway's libraries)
and `polar gateway`: how much of a call's CPU a lean HTTP server and client under the hot routes could save
(issue 30 point 1). It relays fixed-length bodies only (no chunked answers: the fake's JSON calls), one
request at a time per connection (no pipelining), and has no timeouts or limits: a measurement, not a server.

`--server uvicorn` serves the same relay as an ASGI app on uvicorn (httptools), `--client aiohttp` sends
upstream with a pooled aiohttp session: the two halves of bench/passthrough.py, one at a time, to tell which
of the gateway's libraries costs what.

`--store PATH` makes it the least a relay that captures can cost: each call's request and answer bytes, as
they came (nothing parsed, encoded or chained), are inserted into SQLite (WAL, synchronous=NORMAL, as the
gateway's store) and committed before the answer is written; the calls answered in one pass of the loop
share a transaction, as the gateway's do. What a gateway that commits before answering cannot go below.

    .venv/bin/python bench/passthrough_raw.py --backend http://127.0.0.1:8000 --port 8101
    .venv/bin/python bench/passthrough_raw.py --backend http://127.0.0.1:8000 --port 8102 --server uvicorn
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httptools
import uvicorn

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


class Capture:
    """Calls answered in this pass of the loop, committed together in the next one, then answered."""

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS calls (at REAL, request BLOB, answer BLOB)")
        self.pending: list[tuple[Reply, int, bytes, bytes]] = []

    def answered(self, reply: Reply, request: bytes, status: int, answer: bytes) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.commit)
        self.pending.append((reply, status, request, answer))

    def commit(self) -> None:
        batch, self.pending = self.pending, []
        now = time.time()
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("INSERT INTO calls VALUES (?, ?, ?)", [(now, q, a) for _, _, q, a in batch])
        self.db.execute("COMMIT")
        for reply, status, _, answer in batch:
            reply(status, answer)


class Downstream(asyncio.Protocol):
    """One client connection: each complete request relayed through the pool, its answer written back."""

    def __init__(self, pool: Pool | AiohttpPool, capture: Capture | None = None) -> None:
        self.pool = pool
        self.capture = capture
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
        elif self.capture is not None:
            capture, answer = self.capture, self.answer
            self.pool.send(path, body, lambda status, data: capture.answered(answer, body, status, data))
        else:
            self.pool.send(path, body, self.answer)

    def answer(self, status: int, body: bytes) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        head = b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        self.transport.write(head % (status, len(body)) + body)


class AiohttpPool:
    """`Pool`'s `send` over one pooled aiohttp session (a task per call, as an aiohttp caller has)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend.rstrip("/")
        self.http: aiohttp.ClientSession | None = None
        self.calls: set[asyncio.Task[None]] = set()

    def send(self, path: bytes, body: bytes, reply: Reply) -> None:
        async def call() -> None:
            if self.http is None:
                self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            url = self.backend + path.decode()
            async with self.http.post(url, data=body, headers={"content-type": "application/json"}) as r:
                reply(r.status, await r.read())

        task = asyncio.get_running_loop().create_task(call())
        self.calls.add(task)
        task.add_done_callback(self.calls.discard)


class Relay:
    """The relay as an ASGI app (for `--server uvicorn`): the request read, `pool.send`, the answer sent."""

    def __init__(self, pool: Pool | AiohttpPool) -> None:
        self.pool = pool

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        if scope["path"] == "/health":
            answer.set_result((200, b"ok"))
        else:
            self.pool.send(
                scope["path"].encode(), body, lambda status, data: answer.set_result((status, data))
            )
        status, data = await answer
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


async def serve(pool: Pool | AiohttpPool, port: int, capture: Capture | None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Downstream(pool, capture), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--server", choices=["raw", "uvicorn"], default="raw")
    ap.add_argument("--client", choices=["raw", "aiohttp"], default="raw")
    ap.add_argument("--store", metavar="PATH", help="commit each call's bytes to SQLite before answering")
    args = ap.parse_args()
    pool = Pool(args.backend) if args.client == "raw" else AiohttpPool(args.backend)
    if args.server == "raw":
        asyncio.run(serve(pool, args.port, Capture(args.store) if args.store else None))
        return
    if args.store:
        ap.error("--store: with the raw server only")
    uvicorn.run(
        Relay(pool),
        host="127.0.0.1",
        port=args.port,
        loop="asyncio",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
