"""Serving ASGI apps with uvicorn: on the caller's event loop (`EmbeddedServer`) or in a background thread
(`ServerThread`), one listener or several sharing one loop.

Several listeners share a loop when they share state: a gateway's model API and its control listener are
two apps over one proxy, whose store writer and sessions belong to the loop that opened them. The first
listener runs the app's lifespan (opening that state); the others start after it, with lifespan off.

`polar demo`, the CLI servers, in-process setups (a trainer that serves its own engine and gateway) and the
tests use these: every server they talk to is a real uvicorn on a real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import uvicorn

from polar.http_server import http_protocol

Lifespan = Literal["auto", "on", "off"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def urls(host: str, port: int) -> tuple[str, str]:
    """(the URL from this machine, the URL others use) for a bound host and port. A wildcard bind is
    reached on loopback here and by the machine's name from elsewhere."""
    if host in ("0.0.0.0", "::", ""):
        local = f"http://{'[::1]' if host == '::' else '127.0.0.1'}:{port}"
        return local, f"http://{socket.getfqdn()}:{port}"
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return url, url


class _Server(uvicorn.Server):
    """Signals stay with whoever owns the process (the CLI installs its own handlers)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class EmbeddedServer:
    """uvicorn serving `app` on the caller's event loop. `start` binds (raising OSError when the address is
    taken) and returns once the app's startup succeeded; a failed startup raises instead of exiting the
    interpreter (uvicorn's choice for a CLI)."""

    def __init__(self, app: Any, host: str, port: int, *, lifespan: Lifespan = "on", **config: Any) -> None:
        self.app, self.host, self.port = app, host, port
        self.lifespan = lifespan
        # JSON errors for malformed HTTP (polar.http_server), like every other answer polar gives. No
        # log_config: uvicorn's loggers propagate to the process's handlers (polar.cli.common.setup_logging)
        # instead of printing in uvicorn's own format beside them.
        self.config = {
            "log_level": "warning",
            "access_log": False,
            "log_config": None,
            "http": http_protocol(),
            **config,
        }
        self.url = ""
        self.public_url = ""
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self.url, self.public_url = urls(self.host, self.port)
        server = _Server(uvicorn.Config(self.app, lifespan=self.lifespan, **self.config))
        self._task = asyncio.create_task(self._serve(server, sock))
        while not server.started:
            if self._task.done():
                sock.close()
                exc = self._task.exception() if not self._task.cancelled() else None
                raise RuntimeError(f"the server on {self.url} did not start: {exc or 'startup failed'}")
            await asyncio.sleep(0.01)
        self._server = server

    @staticmethod
    async def _serve(server: _Server, sock: socket.socket) -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit:
            raise RuntimeError("the server's startup failed (its error is logged above)") from None

    async def wait(self) -> None:
        """Until the server exits."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._task)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            self._server = None


async def start_all(servers: Sequence[EmbeddedServer]) -> None:
    """Start in order (the first runs the shared lifespan); on failure stop those already started."""
    started: list[EmbeddedServer] = []
    try:
        for server in servers:
            await server.start()
            started.append(server)
    except BaseException:
        await stop_all(started)
        raise


async def stop_all(servers: Sequence[EmbeddedServer]) -> None:
    """Stop in reverse order: listeners that borrow the first one's state go before it closes it."""
    for server in reversed(servers):
        await server.stop()


class ServerThread:
    """`app` on 127.0.0.1 (and each of `also`, apps sharing its loop, lifespan off) in a daemon thread.
    `url` (no trailing slash) is the first listener's, `urls` all of them in order."""

    def __init__(
        self,
        app: Any,
        port: int | None = None,
        *,
        also: Sequence[Any] = (),
        lifespan: Lifespan = "on",
        **uvicorn_kwargs: Any,
    ) -> None:
        self.servers = [EmbeddedServer(app, "127.0.0.1", port or 0, lifespan=lifespan, **uvicorn_kwargs)]
        self.servers += [EmbeddedServer(a, "127.0.0.1", 0, lifespan="off", **uvicorn_kwargs) for a in also]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def port(self) -> int:
        return self.servers[0].port

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await start_all(self.servers)
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        await stop_all(self.servers)

    def start(self) -> ServerThread:
        self.thread.start()
        if not self._ready.wait(timeout=60) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error or 'timed out'}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self.thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=15)


@contextmanager
def serve(app: Any, **kwargs: Any) -> Iterator[ServerThread]:
    srv = ServerThread(app, **kwargs).start()
    try:
        yield srv
    finally:
        srv.stop()
