"""`polar.http_server.CorkedTransport`: the writes of one pass of the event loop leave in one send, in order,
closing sends what is held and aborting drops it; and a polar server's streamed answer still reaches its
client piece by piece."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from polar.http_server import CORK_LIMIT, READ_SIZE, CorkedTransport, small_reads
from polar.serving import ServerThread


async def _pair() -> tuple[asyncio.Transport, list[bytes], socket.socket]:
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    sent: list[bytes] = []
    write = transport.write

    def spy(data: Any) -> None:
        sent.append(bytes(data))
        write(data)

    transport.write = spy  # type: ignore[method-assign]
    theirs.setblocking(False)
    return transport, sent, theirs


async def _read_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    out = b""
    while piece := await loop.sock_recv(sock, 65536):
        out += piece
    return out


async def test_the_writes_of_one_pass_leave_in_one_send_and_closing_sends_what_is_held() -> None:
    transport, sent, theirs = await _pair()
    corked = CorkedTransport(transport, asyncio.get_running_loop())
    for piece in (b"HTTP/1.1 200 OK\r\n\r\n", b"data: 1\n\n", b"data: 2\n\n"):
        corked.write(piece)
    assert sent == []  # held until the loop's next pass
    await asyncio.sleep(0)
    assert sent == [b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\ndata: 2\n\n"]
    corked.write(b"data: 3\n\n")
    assert corked.get_write_buffer_size() >= len(b"data: 3\n\n")
    corked.close()
    assert sent[-1] == b"data: 3\n\n" and corked.is_closing()
    assert await _read_all(theirs) == b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\ndata: 2\n\ndata: 3\n\n"
    theirs.close()


async def test_a_large_answer_written_in_one_pass_is_not_held_back() -> None:
    """Past CORK_LIMIT held bytes the cork sends at once, so the wrapped transport's own buffer limits (and
    uvicorn's flow control on them) still see a large answer written without yielding to the loop."""
    transport, sent, theirs = await _pair()
    corked = CorkedTransport(transport, asyncio.get_running_loop())
    piece = b"x" * (CORK_LIMIT // 4)
    for _ in range(10):
        corked.write(piece)
    assert sum(map(len, sent)) >= 8 * len(piece)  # before the loop's next pass
    assert corked.get_write_buffer_size() >= 10 * len(piece) - sum(map(len, sent))
    corked.close()
    assert len(await _read_all(theirs)) == 10 * len(piece)
    theirs.close()


async def test_aborting_drops_what_is_held() -> None:
    transport, sent, theirs = await _pair()
    corked = CorkedTransport(transport, asyncio.get_running_loop())
    corked.write(b"never sent")
    corked.abort()
    await asyncio.sleep(0)
    assert sent == [] and await _read_all(theirs) == b""
    theirs.close()


@pytest.fixture
def slow_stream() -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
        if scope["path"] == "/held":
            for _ in range(500):  # the client has read the first piece before the rest is written
                if app.got_first:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"data: second\n\n"})

    app.got_first = False  # type: ignore[attr-defined]
    return app


def test_a_polar_server_still_streams_each_piece_as_it_is_written(slow_stream: Any) -> None:
    """Corking holds a write until the loop's next pass, never until more comes: a piece written alone
    reaches the client while the answer is still open."""
    server = ServerThread(slow_stream, lifespan="off").start()
    try:
        with httpx.stream("GET", server.url + "/held", timeout=10) as r:
            pieces = r.iter_bytes()
            assert next(pieces) == b"data: first\n\n"
            slow_stream.got_first = True
            assert b"".join(pieces) == b"data: second\n\n"
    finally:
        server.stop()


async def test_small_reads_caps_an_asyncio_transports_read_and_leaves_others_alone() -> None:
    """asyncio's socket transport reads `max_size` (256 KiB) at a time, allocated whole for each read (and
    served by mmap past glibc's threshold, bench/socket_reads.py); `small_reads` caps it, and a transport
    without the attribute (uvloop's) is left as it is."""
    transport, _, theirs = await _pair()
    assert transport.max_size == 256 * 1024  # type: ignore[attr-defined]  # asyncio's, CPython 3.11
    small_reads(transport)
    assert transport.max_size == READ_SIZE  # type: ignore[attr-defined]
    theirs.sendall(b"x" * (3 * READ_SIZE))  # more than one read's worth still arrives whole
    transport.close()
    theirs.close()

    class Other(asyncio.BaseTransport):
        pass

    other = Other()
    small_reads(other)
    assert not hasattr(other, "max_size")


def test_a_polar_server_and_the_lean_client_read_at_most_read_size(slow_stream: Any) -> None:
    """Both ends of a call the gateway serves: the connection its server accepted and the one its upstream
    client opened read at most READ_SIZE."""
    from polar.gateway.backends import h1

    server = ServerThread(slow_stream, lifespan="off").start()
    try:

        async def call() -> tuple[int, int]:
            pool = h1.H1Pool(server.url, {}, 1, connect_timeout_s=5)
            try:
                status, _ = await pool.request("GET", "/", None)
                (conn,) = pool._all
                assert conn.transport is not None
                return status, conn.transport.max_size  # type: ignore[attr-defined]
            finally:
                await pool.aclose()

        status, client_read = asyncio.run(call())
        assert status == 200 and client_read == READ_SIZE
        with httpx.Client(timeout=10) as client:  # kept alive: its server-side connection is still open
            assert client.get(server.url + "/").status_code == 200
            uv = server.servers[0]._server
            assert uv is not None
            reads = {p.transport.max_size for p in uv.server_state.connections}  # type: ignore[attr-defined]
            assert reads == {READ_SIZE}
    finally:
        server.stop()
