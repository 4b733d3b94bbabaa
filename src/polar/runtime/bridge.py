"""The node side of the gateway bridge: a unix socket whose connections are spliced to the gateway.

A sandbox with its own network namespace cannot reach the host's loopback; it can reach a unix socket
through its file system. The bridge runs its own event loop in a daemon thread so it serves no matter
which loop (or thread) owns the runtime. Inside, `fwd_inside.py` listens on the sandbox's 127.0.0.1 at
the gateway's port and splices to the socket, so the harness is given `http://127.0.0.1:<port>`.

One bridge serves one session, and relays at most `max_connections` connections at once (64 by default,
`POLAR_BRIDGE_MAX_CONNECTIONS`): at the cap it stops accepting, so further connections wait in the kernel's
backlog at no cost to the node, instead of each taking descriptors in the node and the gateway. Without the
cap one agent's half-open connections used up the node's descriptors and every other session's calls timed
out. A relay ends when the gateway closes its side (an HTTP server never half-closes: its close is final), so
a connection the gateway gave up on (`polar.http_server`'s header deadline) frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from polar.edge import Throttle, limit_accept_errors, log_accept_error
from polar.runtime.base import RuntimeFailure

log = logging.getLogger("polar.runtime.bridge")

DEFAULT_MAX_CONNECTIONS = 64
MAX_CONNECTIONS_ENV = "POLAR_BRIDGE_MAX_CONNECTIONS"
_BACKLOG = 128  # connections waiting beyond the cap (then the kernel refuses, or a blocking connect waits)
_ACCEPT_RETRY_S = 0.5  # after accept() failed for want of descriptors: let some close first
# accept() errors that say nothing about the listener (the connection went away before it was accepted)
_TRANSIENT = (errno.ECONNABORTED, errno.EINTR, errno.EPROTO, errno.EAGAIN)
_accept_log = Throttle()


def default_max_connections() -> int:
    """`POLAR_BRIDGE_MAX_CONNECTIONS` when set to a positive integer, else `DEFAULT_MAX_CONNECTIONS`."""
    try:
        value = int(os.environ.get(MAX_CONNECTIONS_ENV, ""))
    except ValueError:
        return DEFAULT_MAX_CONNECTIONS
    return value if value > 0 else DEFAULT_MAX_CONNECTIONS


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
    `unix=True`) and on listening sockets handed to `serve_socket` (a container's loopback,
    `polar.runtime.netns`); at most `max_connections` relayed at once over all of them.
    """

    def __init__(
        self, host: str, port: int, *, unix: bool = True, max_connections: int | None = None
    ) -> None:
        # Short and outside the session dir: a unix socket path must fit in 108 bytes
        self.socket_path = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=_DIR)) / "gw.sock"
        self.unix = unix
        self.host = host
        self.port = port
        self.max_connections = max_connections or default_max_connections()
        self._slots = asyncio.Semaphore(self.max_connections)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="polar-bridge")
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._relays: set[asyncio.Task[None]] = set()
        limit_accept_errors()

    async def _accept(self, listener: socket.socket) -> None:
        """Accept while a slot is free; at the cap, wait for one (the kernel holds new connections)."""
        loop = asyncio.get_running_loop()
        where = f"gateway bridge to {self.host}:{self.port}"
        while True:
            await self._slots.acquire()
            try:
                conn, _ = await loop.sock_accept(listener)
            except asyncio.CancelledError:
                self._slots.release()
                raise
            except OSError as exc:
                self._slots.release()
                if exc.errno in _TRANSIENT:
                    continue
                if listener.fileno() < 0:
                    return  # closed with the bridge
                log_accept_error(log, _accept_log, where, exc)
                await asyncio.sleep(_ACCEPT_RETRY_S)
                continue
            # Held here: the loop keeps only weak references to tasks, and a relay's streams are reachable
            # only from its own frames (a stream protocol holds its reader weakly), so an unheld relay is
            # garbage collected mid-connection ("Task was destroyed but it is pending!").
            relay = loop.create_task(self._relay(conn))
            self._relays.add(relay)
            relay.add_done_callback(self._relay_done)

    def _relay_done(self, relay: asyncio.Task[None]) -> None:
        self._relays.discard(relay)
        self._slots.release()

    async def _relay(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except OSError:
            conn.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        up = asyncio.ensure_future(_splice(up_reader, writer))
        down = asyncio.ensure_future(_splice(reader, up_writer))
        try:
            # The gateway's side ending ends the connection: the client may still hold its own side open
            # (half-open, sending nothing), which would otherwise keep the relay and its slot forever.
            await up
        except asyncio.CancelledError:
            pass  # `close` cancels open relays: this one is over, as if the gateway had closed
        finally:
            for task in (up, down):
                task.cancel()
            for w in (writer, up_writer):
                w.close()  # after what is buffered is sent
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(up, down, return_exceptions=True)

    def _listen(self, listener: socket.socket) -> None:
        async def begin() -> None:
            self._accepting.append(asyncio.get_running_loop().create_task(self._accept(listener)))

        self._listeners.append(listener)
        asyncio.run_coroutine_threadsafe(begin(), self._loop).result(timeout=10)

    def start(self) -> None:
        self._thread.start()
        if not self.unix:
            return
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.socket_path))
            listener.listen(_BACKLOG)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            self.close()
            raise RuntimeFailure(f"cannot start the gateway bridge: {exc}") from exc
        self._listen(listener)

    def serve_socket(self, sock: socket.socket) -> None:
        """Relay the connections of a listening socket (made anywhere, e.g. in a container's network
        namespace) to the gateway too, within the same cap; closed with the bridge."""
        try:
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise RuntimeFailure(f"cannot serve the gateway bridge: {exc}") from exc
        self._listen(sock)

    def close(self) -> None:
        """Stop serving and remove the socket and its directory (idempotent)."""
        if not self._thread.is_alive():
            self._close_listeners()
            self._remove()
            return

        async def shutdown() -> None:
            for task in self._accepting:
                task.cancel()
            await asyncio.gather(*self._accepting, return_exceptions=True)
            self._close_listeners()
            relays = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)  # each closes its connections

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._remove()

    def _close_listeners(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()

    def _remove(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.socket_path.parent.rmdir()
