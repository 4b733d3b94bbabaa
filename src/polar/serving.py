"""Run an ASGI app on a loopback port in a background thread.

`polar demo` and in-process setups (a trainer that serves its own engine and gateway) use it, and so do the
tests: every server they talk to is a real uvicorn on a real socket.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from polar.http_server import http_protocol


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerThread:
    """A uvicorn server on 127.0.0.1 in a daemon thread. `url` has no trailing slash."""

    def __init__(self, app: Any, port: int | None = None, **uvicorn_kwargs: Any) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kwargs: dict[str, Any] = {"log_level": "warning", "lifespan": "on", "http": http_protocol()}
        kwargs.update(uvicorn_kwargs)
        self.config = uvicorn.Config(app, host="127.0.0.1", port=self.port, **kwargs)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def serve(app: Any, **kwargs: Any) -> Iterator[ServerThread]:
    srv = ServerThread(app, **kwargs).start()
    try:
        yield srv
    finally:
        srv.stop()
