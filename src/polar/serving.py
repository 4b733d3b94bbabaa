"""Serving ASGI apps with uvicorn: on the caller's event loop (`EmbeddedServer`) or in a background thread
(`ServerThread`), one listener or several sharing one loop.

Several listeners share a loop when they share state: a gateway's model API and its control listener are
two apps over one proxy, whose store writer and sessions belong to the loop that opened them. The first
listener runs the app's lifespan (opening that state); the others start after it, with lifespan off.

A server binds its address before anything else (`start_all` binds every listener first), so a port in
use is a `BindError` before any app starts; then the app's lifespan runs here, not in uvicorn, so a failed
startup raises `StartupError` carrying the app's own exception instead of a traceback in the log.

`polar demo`, the CLI servers, in-process setups (a trainer that serves its own engine and gateway) and the
tests use these: every server they talk to is a real uvicorn on a real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import threading
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, cast

import uvicorn

from polar.edge import prepare_server_process
from polar.http_server import http_protocol

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

Lifespan = Literal["auto", "on", "off"]
log = logging.getLogger("polar.serving")


class BindError(OSError):
    """The listener's address cannot be bound; `str()` says why in words (port in use, no such address)."""

    def __init__(self, host: str, port: int, label: str, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror)
        self.host, self.port, self.label = host, port, label
        self.in_use = cause.errno == errno.EADDRINUSE
        where = f"{host}:{port}"
        if self.in_use:
            self.message = f"{label} {port} on {host} is in use"
        elif cause.errno == errno.EACCES:
            self.message = f"cannot listen on {where}: permission denied (ports below 1024 need privileges)"
        elif cause.errno == errno.EADDRNOTAVAIL:
            self.message = f"cannot listen on {where}: {host} is not an address of this machine"
        elif isinstance(cause, socket.gaierror):
            self.message = f"cannot listen on {where}: unknown host {host!r}"
        else:
            self.message = f"cannot listen on {where}: {cause.strerror or cause}"

    def __str__(self) -> str:
        return self.message


class StartupError(RuntimeError):
    """The app's startup (its ASGI lifespan) failed; `error` is the exception it raised."""

    def __init__(self, url: str, error: BaseException) -> None:
        super().__init__(str(error) or type(error).__name__)
        self.url, self.error = url, error


class _Lifespan:
    """An app's ASGI lifespan, driven here (what uvicorn's `lifespan="on"` would do), so that a failed
    startup raises the app's own exception to the caller instead of uvicorn logging its traceback."""

    def __init__(self, app: ASGIApp, required: bool) -> None:
        self.app, self.required = app, required
        self.state: dict[str, Any] = {}
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _next(self) -> Message | None:
        """The app's next message; None when it returned or raised instead."""
        assert self._task is not None
        if self._outbox.empty() and not self._task.done():
            get = asyncio.ensure_future(self._outbox.get())
            await asyncio.wait({get, self._task}, return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                return get.result()
            get.cancel()
        return self._outbox.get_nowait() if not self._outbox.empty() else None

    async def _error(self) -> BaseException | None:
        """What the app raised (it raises right after reporting a failure, as Starlette does)."""
        assert self._task is not None
        await asyncio.wait({self._task}, timeout=10)
        if not self._task.done() or self._task.cancelled():
            return None
        return self._task.exception()

    async def startup(self, url: str) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self.state}
        # An ASGI app is an `async def` (or an object whose `__call__` is one): its call is a coroutine.
        run = self.app(scope, self._inbox.get, self._outbox.put)
        self._task = asyncio.create_task(cast("Coroutine[Any, Any, None]", run))
        await self._inbox.put({"type": "lifespan.startup"})
        message = await self._next()
        if message is not None and message["type"] == "lifespan.startup.complete":
            return
        error = await self._error()
        self._task = None
        if message is None and (error is None or not self.required):
            return  # the app does not speak the protocol (returned, or raised under "auto"): no lifespan
        if error is None:
            text = str((message or {}).get("message") or "").strip()
            error = RuntimeError(text.splitlines()[-1] if text else "the app's startup failed")
        raise StartupError(url, error) from error

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            self._task = None
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        message = await self._next()
        if message is not None and message["type"] == "lifespan.shutdown.failed":
            log.error("the app's shutdown failed: %s", message.get("message", ""))
        await asyncio.wait({self._task})
        if not self._task.cancelled() and (error := self._task.exception()) is not None:
            log.error("the app's lifespan ended with %s: %s", type(error).__name__, error)
        self._task = None

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """`app`, given the state the lifespan yielded (in each request's scope), if it yielded any."""
        if not self.state:
            return app
        state = self.state

        async def with_state(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] in ("http", "websocket"):
                scope["state"] = {**state, **scope.get("state", {})}
            await app(scope, receive, send)

        return with_state


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
    def capture_signals(self) -> Iterator[None]:
        yield


class EmbeddedServer:
    """uvicorn serving `app` on the caller's event loop. `start` binds (`BindError` when the address is
    taken), runs the app's startup (`StartupError` with the app's exception when it fails) and returns once
    the server accepts connections; nothing exits the interpreter (uvicorn's choice for a CLI). `bind`
    alone reserves the address early (`polar serve-model` binds before loading a model). `label` names the
    listener in a `BindError` ("port", "control port"). `app` may be None until `start` (set `.app` after
    an early `bind`). `sock`: a listening socket bound elsewhere (a gateway worker serves the sockets its
    supervisor bound), served instead of binding `host`:`port`."""

    def __init__(
        self,
        app: ASGIApp | None,
        host: str,
        port: int,
        *,
        lifespan: Lifespan = "on",
        label: str = "port",
        sock: socket.socket | None = None,
        **config: Any,
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self.lifespan = lifespan
        self.label = label
        # JSON errors for malformed HTTP and a deadline for request headers (polar.http_server). No
        # log_config: uvicorn's loggers propagate to the process's handlers (polar.logs.setup_logging)
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
        self._sock: socket.socket | None = sock
        if sock is not None:
            self.port = sock.getsockname()[1]
            self.url, self.public_url = urls(self.host, self.port)
        self._life: _Lifespan | None = None
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    def bind(self) -> None:
        """Bind the address now (idempotent); `BindError` says why it cannot be."""
        if self._sock is not None:
            return
        prepare_server_process()  # the open-files limit raised, accept errors throttled (polar.edge)
        try:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off only on sockets whose `proto`
            # says TCP, and accepted sockets inherit the listener's. With Nagle on, each SSE event after the
            # response headers waited for the client's delayed ACK: 40 ms before a stream's first token.
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        except OSError as exc:
            raise BindError(self.host, self.port, self.label, exc) from None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets (Linux)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise BindError(self.host, self.port, self.label, exc) from None
        self._sock = sock
        self.port = sock.getsockname()[1]
        self.url, self.public_url = urls(self.host, self.port)

    @property
    def sock(self) -> socket.socket | None:
        """The bound listening socket (after `bind`)."""
        return self._sock

    def _release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def start(self) -> None:
        self.bind()
        assert self._sock is not None
        assert self.app is not None, "EmbeddedServer.app is set before start"
        sock = self._sock
        app = self.app
        if self.lifespan != "off":
            self._life = _Lifespan(self.app, required=self.lifespan == "on")
            try:
                await self._life.startup(self.url)
            except BaseException:
                self._life = None
                self._release()
                raise
            app = self._life.wrap(self.app)
        server = _Server(uvicorn.Config(app, lifespan="off", **self.config))
        self._task = asyncio.create_task(self._serve(server, sock))
        while not server.started:
            if self._task.done():
                self._release()
                exc = self._task.exception() if not self._task.cancelled() else None
                await self._shutdown_app()
                raise RuntimeError(f"the server on {self.url} did not start: {exc or 'startup failed'}")
            await asyncio.sleep(0.01)
        self._server = server

    async def _shutdown_app(self) -> None:
        life, self._life = self._life, None
        if life is not None:
            await life.shutdown()

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
        """Stop serving (connections closed, as uvicorn does), then run the app's shutdown."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            self._server = None
        await self._shutdown_app()
        self._release()


async def start_all(servers: Sequence[EmbeddedServer]) -> None:
    """Bind every listener, then start them in order (the first runs the shared lifespan); on failure
    stop those already started and release every address."""
    started: list[EmbeddedServer] = []
    try:
        for server in servers:
            server.bind()
        for server in servers:
            await server.start()
            started.append(server)
    except BaseException:
        await stop_all(started)
        for server in servers:
            server._release()
        raise


async def stop_all(servers: Sequence[EmbeddedServer]) -> None:
    """Stop in reverse order: listeners that borrow the first one's state go before it closes it."""
    for server in reversed(servers):
        await server.stop()


class ServerThread:
    """`app` on 127.0.0.1 or `host` (and each of `also` on 127.0.0.1, apps sharing its loop, lifespan off)
    in a daemon thread. `url` (no trailing slash) is the first listener's, `urls` all of them in order."""

    def __init__(
        self,
        app: ASGIApp,
        port: int | None = None,
        *,
        also: Sequence[ASGIApp] = (),
        lifespan: Lifespan = "on",
        host: str = "127.0.0.1",
        **uvicorn_kwargs: Any,
    ) -> None:
        self.servers = [EmbeddedServer(app, host, port or 0, lifespan=lifespan, **uvicorn_kwargs)]
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
        ready = self._ready.wait(timeout=60)
        if isinstance(self._error, (BindError, StartupError)):
            raise self._error  # says which address, or what the app's startup raised
        if not ready or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error or 'timed out'}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self.thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=15)


@contextmanager
def serve(app: ASGIApp, **kwargs: Any) -> Iterator[ServerThread]:
    srv = ServerThread(app, **kwargs).start()
    try:
        yield srv
    finally:
        srv.stop()
