"""uvicorn on the caller's event loop, for the node's HTTP face.

The node's sessions, its gateway and its routes share one loop: the gateway creates sessions in-process and
the harnesses (subprocesses) call it over loopback. Signals stay with whoever owns the process, and a
failed application startup raises instead of exiting the interpreter (uvicorn's choice for a CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import uvicorn

from polar.http_server import http_protocol


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def urls(host: str, port: int) -> tuple[str, str]:
    """(the URL from this machine, the URL others use) for a bound host and port. A wildcard bind is
    reached on loopback here and by the machine's name from elsewhere."""
    if host in ("0.0.0.0", "::", ""):
        local = f"http://{'[::1]' if host == '::' else '127.0.0.1'}:{port}"
        return local, f"http://{socket.getfqdn()}:{port}"
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return url, url


class EmbeddedServer:
    def __init__(self, app: Any, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self.url = ""
        self.public_url = ""
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind, serve, and return once the app's startup (the gateway's lifespan) succeeded."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.url, self.public_url = urls(self.host, sock.getsockname()[1])
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="on", access_log=False, http=http_protocol()
        )
        server = _Server(config)
        self._task = asyncio.create_task(self._serve(server, sock))
        while not server.started:
            if self._task.done():
                sock.close()
                exc = self._task.exception() if not self._task.cancelled() else None
                raise RuntimeError(f"the node's gateway did not start: {exc or 'startup failed'}")
            await asyncio.sleep(0.01)
        self._server = server

    @staticmethod
    async def _serve(server: _Server, sock: socket.socket) -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit:
            raise RuntimeError("the gateway's startup failed (its error is logged above)") from None

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
