"""The node side of the gateway bridge: a unix socket whose connections are spliced to the gateway.

A sandbox with its own network namespace cannot reach the host's loopback; it can reach a unix socket
through its file system. The bridge runs its own event loop in a daemon thread so it serves no matter
which loop (or thread) owns the runtime. Inside, `fwd_inside.py` listens on the sandbox's 127.0.0.1 at
the gateway's port and splices to the socket, so the harness is given `http://127.0.0.1:<port>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from polar.runtime.base import RuntimeFailure


def gateway_address(url: str) -> tuple[str, int, str]:
    """(host, port, url as seen inside a sandbox) of the gateway URL the host uses."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RuntimeFailure(f"gateway URL {url!r} is not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname, port, f"{parts.scheme}://127.0.0.1:{port}{parts.path.rstrip('/')}"


async def _splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


_DIR, _PREFIX = "/tmp", "polar-gw-"


def remove_stale_bridges(min_age_s: float = 60.0) -> int:
    """Remove the bridge directories of runtimes whose node died without closing them (SIGKILL): ours,
    older than `min_age_s` (one being set up right now has no listener yet), whose socket refuses."""
    removed = 0
    for folder in Path(_DIR).glob(f"{_PREFIX}*"):
        try:
            st = folder.lstat()
        except OSError:
            continue
        if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode) or time.time() - st.st_mtime < min_age_s:
            continue
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(str(folder / "gw.sock"))
            continue  # someone serves it
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed


class UnixBridge:
    """Serves connections to the gateway at `host:port`: on a unix socket (for bwrap and local sandboxes,
    `unix=True`) and on listening sockets handed to `serve_socket` (a container's loopback, `polar.runtime.netns`).
    """

    def __init__(self, host: str, port: int, *, unix: bool = True) -> None:
        # Short and outside the session dir: a unix socket path must fit in 108 bytes
        self.socket_path = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=_DIR)) / "gw.sock"
        self.unix = unix
        self.host = host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="polar-bridge")
        self._server: asyncio.AbstractServer | None = None
        self._extra: list[asyncio.AbstractServer] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_splice(reader, up_writer), _splice(up_reader, writer))
        except asyncio.CancelledError:
            # `close` cancels open relays. A handler task that ends cancelled makes CPython 3.11's
            # StreamReaderProtocol callback call task.exception(), which raises, and asyncio logs an ERROR
            # with a traceback ("Exception in callback ... connection_made") for a normal shutdown
            # (fixed in 3.12). Ending normally instead is what the bridge means: the relay is over.
            pass
        finally:
            for w in (writer, up_writer):
                w.close()

    def start(self) -> None:
        self._thread.start()
        if not self.unix:
            return
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_unix_server(self._handle, path=str(self.socket_path)), self._loop
        )
        try:
            self._server = future.result(timeout=10)
        except OSError as exc:
            self.close()
            raise RuntimeFailure(f"cannot start the gateway bridge: {exc}") from exc

    def serve_socket(self, sock: socket.socket) -> None:
        """Relay the connections of a listening socket (made anywhere, e.g. in a container's network
        namespace) to the gateway too; closed with the bridge."""
        future = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, sock=sock), self._loop)
        try:
            self._extra.append(future.result(timeout=10))
        except OSError as exc:
            sock.close()
            raise RuntimeFailure(f"cannot serve the gateway bridge: {exc}") from exc

    def close(self) -> None:
        """Stop serving and remove the socket and its directory (idempotent)."""
        if not self._thread.is_alive():
            self._remove()
            return

        async def shutdown() -> None:
            for server in (self._server, *self._extra):
                if server is not None:
                    server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._remove()

    def _remove(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.socket_path.parent.rmdir()
