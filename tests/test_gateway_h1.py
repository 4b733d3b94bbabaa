"""The gateway's lean HTTP/1.1 client (polar.gateway.backends.h1) against real servers on loopback: uvicorn
(what vLLM and SGLang serve through) for the ordinary answers, and raw asyncio servers that misbehave on
purpose (close idle connections, drop mid-answer, answer garbage) for the failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
import uvicorn

from polar.gateway.backends import h1
from polar.gateway.backends.base import BackendOptions
from polar.gateway.backends.http import UpstreamClient, UpstreamUnavailable
from polar.gateway.errors import GatewayError
from polar.serving import free_port

HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


class Echo:
    """An ASGI app: the request (method, path, headers, body) back as JSON; `/chunked` in chunks, `/slow`
    after a second; counts the connections it saw."""

    def __init__(self) -> None:
        self.clients: set[Any] = set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.clients.add(tuple(scope["client"]))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        out = orjson.dumps(
            {"method": scope["method"], "path": scope["path"], "headers": headers, "body": body.decode()}
        )
        if scope["path"] == "/slow":
            await asyncio.sleep(1.0)
        if scope["path"] == "/chunked":  # no content-length: uvicorn sends transfer-encoding: chunked
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            for i in range(0, len(out), 7):
                await send({"type": "http.response.body", "body": out[i : i + 7], "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        status = 503 if scope["path"] == "/busy" else 200
        start = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": start})
        await send({"type": "http.response.body", "body": out})


@contextlib.asynccontextmanager
async def uvicorn_server(app: Any) -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def raw_server(on_request: Callable[[asyncio.StreamWriter, int], None]) -> AsyncIterator[str]:
    """A server that reads one request's head and lets `on_request(writer, n)` answer the n-th request."""
    count = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                count += 1
                on_request(writer, count)
                await writer.drain()
                if writer.is_closing():
                    return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


def pool(url: str, max_connections: int = 8) -> h1.H1Pool:
    return h1.H1Pool(url, HEADERS, max_connections, connect_timeout_s=5)


async def test_answers_come_back_whole_on_one_kept_alive_connection() -> None:
    app = Echo()
    async with uvicorn_server(app) as url:
        p = pool(url + "/v1")
        try:
            for i in range(5):
                status, raw = await p.request("POST", "/chat", b'{"n": %d}' % i)
                got = orjson.loads(raw)
                assert status == 200 and got["method"] == "POST" and got["path"] == "/v1/chat"
                assert got["body"] == f'{{"n": {i}}}' and got["headers"]["content-type"] == "application/json"
                assert got["headers"]["host"] == url.removeprefix("http://")
            status, raw = await p.request("GET", "/models", None)
            assert status == 200 and orjson.loads(raw)["method"] == "GET"
            status, raw = await p.request("POST", "/chunked", b"x" * 100)  # decoded by the parser
            assert status == 200 and orjson.loads(raw)["body"] == "x" * 100
        finally:
            await p.aclose()
    assert len(app.clients) == 1  # every call on the same connection


async def test_concurrent_calls_stay_within_the_connection_limit() -> None:
    app = Echo()
    async with uvicorn_server(app) as url:
        p = pool(url, max_connections=3)
        try:
            got = await asyncio.gather(*(p.request("POST", "/x", b"%d" % i) for i in range(12)))
        finally:
            await p.aclose()
    assert sorted(orjson.loads(raw)["body"] for _, raw in got) == sorted(str(i) for i in range(12))
    assert len(app.clients) <= 3


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    """A server that answers and then closes (as uvicorn does to a keep-alive connection idle for 5 s):
    the next call opens a new connection instead of failing on the closed one."""

    def answer_then_close(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        writer.close()

    async with raw_server(answer_then_close) as url:
        p = pool(url)
        try:
            for _ in range(3):
                assert await p.request("POST", "/x", b"{}") == (200, b"{}")
                await asyncio.sleep(0.05)  # the close arrives while the connection is idle
        finally:
            await p.aclose()


async def test_connection_close_in_the_answer_is_honoured() -> None:
    def answer_close(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}")

    async with raw_server(answer_close) as url:
        p = pool(url)
        try:
            assert await p.request("POST", "/x", b"{}") == (200, b"{}")
            assert not p._idle  # not kept: the server said it closes it
        finally:
            await p.aclose()


async def test_an_answer_without_length_or_chunks_ends_where_the_server_closes() -> None:
    """RFC 9112 section 6.3's last rule, as an HTTP/1.0 server answers (Python's http.server): no
    content-length, no chunks, the close is the end. Twice, so each call opens its own connection."""

    def http10(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n")
        writer.write(b'{"n": %d, ' % n)
        writer.write(b'"pad": "%s"}' % (b"x" * 100_000))  # more than one read's worth
        writer.close()

    async with raw_server(http10) as url:
        p = pool(url)
        try:
            for n in (1, 2):
                status, raw = await p.request("POST", "/x", b"{}")
                assert status == 200 and orjson.loads(raw)["n"] == n and len(raw) > 100_000
                assert not p._idle and not p._all  # closed: never reused
        finally:
            await p.aclose()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}", h1.Dropped),  # closed mid-body
        (b"", h1.Dropped),  # closed before any byte
        (b"NOT HTTP AT ALL\r\n\r\n", h1.Malformed),
    ],
)
async def test_an_answer_cut_short_or_malformed_is_an_error_and_the_connection_dropped(
    answer: bytes, error: type[Exception]
) -> None:
    def bad(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(answer)
        writer.close()

    async with raw_server(bad) as url:
        p = pool(url)
        try:
            with pytest.raises(error):
                await p.request("POST", "/x", b"{}")
            assert not p._idle and not p._all
        finally:
            await p.aclose()


async def test_no_server_is_unreachable() -> None:
    p = pool(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(h1.Unreachable):
        await p.request("POST", "/x", b"{}")


async def test_a_call_cancelled_mid_answer_closes_its_connection() -> None:
    app = Echo()
    async with uvicorn_server(app) as url:
        p = pool(url)
        try:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await p.request("POST", "/slow", b"{}")
            assert not p._idle and not p._all  # its answer may still come: the connection is not reused
            assert (await p.request("POST", "/x", b"{}"))[0] == 200
        finally:
            await p.aclose()
    assert len(app.clients) == 2


async def test_a_call_past_its_deadline_times_out_waiting_for_its_answer_or_for_a_slot() -> None:
    """Deadlines are checked by one sweep for all calls in flight (no timer per call): a call whose answer
    has not come by then fails with TimeoutError and its connection is closed; one still waiting for a
    free connection fails the same way; the sweep stops once nothing is in flight."""
    app = Echo()
    async with uvicorn_server(app) as url:
        p = pool(url, max_connections=1)
        loop = asyncio.get_running_loop()
        try:
            slow = asyncio.create_task(p.request("POST", "/slow", b"{}", loop.time() + 0.2))
            await asyncio.sleep(0.05)  # it holds the only connection
            with pytest.raises(TimeoutError):
                await p.request("POST", "/x", b"{}", loop.time() + 0.05)  # never got a slot
            with pytest.raises(TimeoutError):
                await slow
            assert not p._idle and not p._all and not p._deadlines
            assert (await p.request("POST", "/x", b"{}", loop.time() + 5))[0] == 200
            await asyncio.sleep(2 * h1.SWEEP_S)
            assert p._sweeper is None  # nothing in flight: no sweeping
        finally:
            await p.aclose()


def test_only_plain_http_origins_and_the_host_header_as_the_url_writes_it() -> None:
    with pytest.raises(ValueError, match="http://host"):
        h1.H1Pool("https://example.com", HEADERS, 1, 1)
    assert h1.H1Pool("http://[::1]:8000/v1", HEADERS, 1, 1)._head.startswith(b"Host: [::1]:8000\r\n")
    assert h1.H1Pool("http://vllm.internal", HEADERS, 1, 1)._head.startswith(b"Host: vllm.internal\r\n")


async def test_the_upstream_client_maps_the_lean_clients_failures_as_it_maps_aiohttps() -> None:
    """Through `UpstreamClient`: a 503 and an unreachable server are retried and then UpstreamUnavailable,
    a timeout is a `timeout` error, an answer that is not HTTP an `upstream_error`."""
    options = BackendOptions(timeout_s=0.3, retries=1, retry_backoff_s=0.01)
    app = Echo()
    async with uvicorn_server(app) as url:
        client = UpstreamClient(url, options)
        assert client._h1 is not None  # an operator's http:// server: the lean client
        try:
            assert (await client.post("/x", {"a": 1}))["body"] == '{"a":1}'
            with pytest.raises(UpstreamUnavailable) as busy:
                await client.post("/busy", {})
            assert "(HTTP 503)" in busy.value.message
            with pytest.raises(GatewayError) as slow:
                await client.post("/slow", {})
            assert slow.value.kind == "timeout"
        finally:
            await client.aclose()
    gone = UpstreamClient(f"http://127.0.0.1:{free_port()}", options)
    with pytest.raises(UpstreamUnavailable, match="unreachable"):
        await gone.post("/x", {})

    def garbage(writer: asyncio.StreamWriter, n: int) -> None:
        writer.write(b"SPDY/9 nonsense\r\n\r\n")

    async with raw_server(garbage) as url:
        client = UpstreamClient(url, options)
        try:
            with pytest.raises(GatewayError, match="malformed HTTP answer") as bad:
                await client.post("/x", {})
            assert bad.value.kind == "upstream_error"
        finally:
            await client.aclose()


def test_a_pool_used_from_a_second_event_loop_starts_over() -> None:
    """A connection belongs to the loop that made it: the same pool used again from a new loop (a check
    before a server starts, then the server) makes new ones instead of writing on the old loop's."""
    app = Echo()

    async def twice(p: h1.H1Pool, url: str) -> None:
        for _ in range(2):
            assert (await p.request("POST", "/x", b"{}"))[0] == 200

    async def main() -> None:
        async with uvicorn_server(app) as url:
            p = pool(url)
            await twice(p, url)
            done = asyncio.Event()

            def other_loop() -> None:
                asyncio.run(twice(p, url))
                done.set()

            await asyncio.to_thread(other_loop)
            await p.aclose()

    asyncio.run(main())
    assert len(app.clients) == 2


def test_the_pool_runs_on_uvloop() -> None:
    """Ray's actors run their event loop on uvloop, whose transports are not asyncio.Transport subclasses
    (a gateway node on Ray could not start when the client asserted they were)."""
    uvloop = pytest.importorskip("uvloop")
    app = Echo()

    async def main() -> None:
        async with uvicorn_server(app) as url:
            p = pool(url)
            try:
                for _ in range(2):
                    assert (await p.request("POST", "/x", b"{}"))[0] == 200
            finally:
                await p.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    assert len(app.clients) == 1
