"""Streamed answers over the gateway's lean HTTP/1.1 client (`h1.H1Pool.open_stream`, and `UpstreamClient.
stream` on it) against real servers on loopback: uvicorn serving server-sent events as vLLM and SGLang do,
and raw asyncio servers that stall, drop mid-body or flood the reader."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from polar.gateway.backends import h1
from polar.gateway.backends.base import BackendOptions
from polar.gateway.backends.http import UpstreamClient, UpstreamUnavailable
from polar.gateway.errors import GatewayError
from tests.test_gateway_h1 import HEADERS, raw_server, uvicorn_server

SSE = {"Accept": "text/event-stream"}
# A raw server's head of an event stream in chunks (the blank line ends it; chunks follow).
CHUNKED_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"


class Events:
    """An ASGI app streaming server-sent events: `data: {"i": n}` for n in 0..2, the second one held until
    `go` is set, then `data: [DONE]`. `/json` answers plain JSON, `/busy` 503; on `/hold` it waits for the
    client to go away after the first event and records that it saw the disconnect."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.gone = asyncio.Event()
        self.clients: set[Any] = set()
        self.accept: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.clients.add(tuple(scope["client"]))
        self.accept.append(dict(scope["headers"]).get(b"accept", b"").decode())
        while (await receive()).get("more_body"):
            pass
        if scope["path"] in ("/json", "/busy"):
            status = 503 if scope["path"] == "/busy" else 200
            head = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": status, "headers": head})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "no"}}'})
            return
        head = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        for i in range(3):
            if i == 1:
                if scope["path"] == "/hold":
                    if (await receive())["type"] == "http.disconnect":
                        self.gone.set()
                    return
                await self.go.wait()
            event = b"data: " + orjson.dumps({"i": i}) + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def pool(url: str, max_connections: int = 8) -> h1.H1Pool:
    return h1.H1Pool(url, HEADERS, max_connections, connect_timeout_s=5, stream_headers=SSE)


def deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_a_stream_hands_on_each_piece_before_the_answer_ends_and_its_connection_serves_again() -> None:
    app = Events()
    async with uvicorn_server(app) as url:
        p = pool(url)
        try:
            stream = await p.open_stream("/v1/chat", b"{}", deadline(10))
            assert (stream.status, stream.content_type) == (200, "text/event-stream")
            assert await stream.read() == b'data: {"i":0}\n\n'  # while the server holds the rest
            app.go.set()
            rest = b""
            while piece := await stream.read():
                rest += piece
            assert rest == b'data: {"i":1}\n\ndata: {"i":2}\n\ndata: [DONE]\n\n'
            stream.release()
            assert len(p._idle) == 1
            assert (await p.request("POST", "/json", b"{}"))[0] == 200
        finally:
            await p.aclose()
    assert len(app.clients) == 1  # the stream's connection answered the next call
    assert app.accept == ["text/event-stream", "application/json"]


async def test_an_abandoned_stream_closes_its_connection_so_the_server_stops_and_its_slot_is_free() -> None:
    """Closing the connection is how vLLM and SGLang learn to abort a generation."""
    app = Events()
    async with uvicorn_server(app) as url:
        p = pool(url, max_connections=1)
        try:
            stream = await p.open_stream("/hold", b"{}", deadline(10))
            assert await stream.read() == b'data: {"i":0}\n\n'
            stream.close()
            await asyncio.wait_for(app.gone.wait(), 10)
            assert not p._idle and not p._all
            # The one slot was given back: this does not wait forever.
            assert (await asyncio.wait_for(p.request("POST", "/json", b"{}"), 10))[0] == 200
        finally:
            await p.aclose()


async def test_a_stream_waiting_for_a_free_connection_is_bounded_by_its_deadline() -> None:
    app = Events()
    async with uvicorn_server(app) as url:
        p = pool(url, max_connections=1)
        try:
            held = await p.open_stream("/hold", b"{}", deadline(10))  # the only connection
            with pytest.raises(TimeoutError):
                await p.open_stream("/v1/chat", b"{}", deadline(0.1))
            held.close()
            app.go.set()
            stream = await p.open_stream("/v1/chat", b"{}", deadline(10))  # the slot came back
            assert stream.status == 200
            stream.close()
        finally:
            await p.aclose()


async def test_a_stream_past_its_deadline_is_a_timeout_in_its_head_or_its_body() -> None:
    def stall_after_one_event(writer: asyncio.StreamWriter, n: int) -> None:
        if n == 1:  # the head and one chunk, then nothing
            writer.write(CHUNKED_SSE_HEAD)
            writer.write(b"\r\n9\r\ndata: 1\n\n\r\n")
        # the second request gets no answer at all

    async with raw_server(stall_after_one_event) as url:
        p = pool(url)
        try:
            stream = await p.open_stream("/x", b"{}", deadline(0.3))
            assert await stream.read() == b"data: 1\n\n"
            with pytest.raises(TimeoutError):
                await stream.read()
            stream.close()
            with pytest.raises(TimeoutError):
                await p.open_stream("/x", b"{}", deadline(0.3))
            assert not p._idle and not p._all
        finally:
            await p.aclose()


async def test_a_stream_cut_short_is_dropped() -> None:
    def cut(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(CHUNKED_SSE_HEAD)
        writer.write(b"\r\n9\r\ndata: 1\n\n\r\n")
        writer.close()  # no last chunk

    async with raw_server(cut) as url:
        p = pool(url)
        try:
            stream = await p.open_stream("/x", b"{}", deadline(10))
            with pytest.raises(h1.Dropped):
                while await stream.read():
                    pass
            stream.close()
            assert not p._all
        finally:
            await p.aclose()


async def test_a_stream_without_length_or_chunks_ends_where_the_server_closes() -> None:
    """An event stream from an HTTP/1.0 server (no chunks: the close ends it) is whole, not dropped."""

    def http10(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        writer.write(b"data: 1\n\ndata: [DONE]\n\n")
        writer.close()

    async with raw_server(http10) as url:
        p = pool(url)
        try:
            stream = await p.open_stream("/x", b"{}", deadline(10))
            body = b""
            while piece := await stream.read():
                body += piece
            assert body == b"data: 1\n\ndata: [DONE]\n\n" and stream.content_type == "text/event-stream"
            stream.release()
            assert not p._all
        finally:
            await p.aclose()


async def test_a_reader_that_falls_behind_pauses_the_socket_and_loses_nothing() -> None:
    size = 3 * h1.STREAM_BUFFER
    body = bytes(range(256)) * (size // 256)

    def flood(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % size
        )
        writer.write(body)

    async with raw_server(flood) as url:
        p = pool(url)
        try:
            stream = await p.open_stream("/x", b"{}", deadline(30))
            for _ in range(200):  # let the server's bytes arrive while nothing reads them
                await asyncio.sleep(0.01)
                if stream._paused:
                    break
            assert stream._paused and stream._buffered <= 2 * h1.STREAM_BUFFER
            got = b""
            while piece := await stream.read():
                got += piece
            assert got == body and not stream._paused
            stream.release()
        finally:
            await p.aclose()


async def test_the_upstream_client_streams_over_the_lean_client_with_the_same_outcomes() -> None:
    """`UpstreamClient.stream` to an operator's http:// server: the events decoded up to [DONE]; a 503 before
    the stream began retried then UpstreamUnavailable; a 2xx that is not an event stream an upstream_error;
    a connection dropped mid-stream an upstream_error that says so; leaving early closes the connection."""
    options = BackendOptions(timeout_s=10, retries=1, retry_backoff_s=0.01)
    app = Events()
    app.go.set()
    async with uvicorn_server(app) as url:
        client = UpstreamClient(url, options)
        assert client._h1 is not None
        try:
            assert [e async for e in client.stream("/v1/chat", {})] == [{"i": 0}, {"i": 1}, {"i": 2}]
            with pytest.raises(UpstreamUnavailable, match=r"\(HTTP 503\)"):
                [e async for e in client.stream("/busy", {})]
            with pytest.raises(GatewayError, match="application/json, not an event stream"):
                [e async for e in client.stream("/json", {})]
            events = client.stream("/hold", {})
            assert await anext(events) == {"i": 0}
            await events.aclose()
            await asyncio.wait_for(app.gone.wait(), 10)
        finally:
            await client.aclose()
    assert len(app.clients) == 1  # kept alive across calls, the failed ones included

    def cut(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(CHUNKED_SSE_HEAD)
        writer.write(b'\r\n10\r\ndata: {"i": 0}\n\n\r\n')
        writer.close()

    async with raw_server(cut) as url:
        client = UpstreamClient(url, options)
        try:
            events = client.stream("/x", {})
            assert await anext(events) == {"i": 0}
            with pytest.raises(GatewayError, match=r"dropped the connection.*mid-stream") as dropped:
                await anext(events)
            assert dropped.value.kind == "upstream_error"
        finally:
            await client.aclose()
