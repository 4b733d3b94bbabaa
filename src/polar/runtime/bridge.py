"""The node side of the gateway bridge: a unix socket whose connections are spliced to the gateway.

A sandbox with its own network namespace cannot reach the host's loopback; it can reach a unix socket
bound into its file system. The bridge runs its own event loop in a daemon thread so it serves no matter
which loop (or thread) owns the runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path


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


class UnixBridge:
    def __init__(self, socket_path: Path, host: str, port: int) -> None:
        self.socket_path = socket_path
        self.host = host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="polar-bridge")
        self._server: asyncio.AbstractServer | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_splice(reader, up_writer), _splice(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    def start(self) -> None:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_unix_server(self._handle, path=str(self.socket_path)), self._loop
        )
        self._server = future.result(timeout=10)

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self.socket_path.unlink(missing_ok=True)
