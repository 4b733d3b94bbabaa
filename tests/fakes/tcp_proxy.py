"""A loopback TCP proxy that drops its first N connections, then forwards bytes: a server that flaps.

Used to prove that a dropped connection is retried on a fresh one (what a stale keep-alive connection or a
restarting server looks like to an HTTP client). It runs in the test's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib


class DroppingProxy:
    def __init__(self, target_port: int, drop_first: int) -> None:
        self.target_port = target_port
        self.drop_first = drop_first
        self.connections = 0
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> DroppingProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.connections <= self.drop_first:
            await reader.read(1)  # the client has sent its request: now hang up without answering
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def __aenter__(self) -> DroppingProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    dst.close()
