"""The gateway bridge (polar.runtime.bridge): a relay from a sandbox's unix socket to the gateway's port."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest

from polar.runtime.bridge import UnixBridge


def test_closing_the_bridge_with_a_relay_open_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """Seen in a training run on CPython 3.11: a session ended while its harness still held a connection,
    and closing the bridge logged `ERROR asyncio: Exception in callback ... connection_made` with a
    CancelledError traceback. Closing with a relay open must be quiet, and the relay must end."""
    upstream = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(upstream.accept()[0]), daemon=True).start()
    bridge = UnixBridge("127.0.0.1", upstream.getsockname()[1])
    bridge.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(str(bridge.socket_path))
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        deadline = time.monotonic() + 10
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert accepted, "the bridge never connected upstream"
        assert accepted[0].recv(64).startswith(b"GET /")  # the relay is live
        # What `close` does first (cancel the relays), with the loop left running long enough for the
        # tasks' done callbacks, where 3.11 raised; `close` itself stops the loop and may skip them.
        loop = bridge._loop
        errors: list[dict[str, object]] = []
        loop.call_soon_threadsafe(loop.set_exception_handler, lambda _loop, ctx: errors.append(ctx))

        async def cancel_relays() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await asyncio.sleep(0.2)

        asyncio.run_coroutine_threadsafe(cancel_relays(), loop).result(timeout=10)
        with caplog.at_level(logging.DEBUG, logger="asyncio"):
            bridge.close()
        assert errors == []
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        client.settimeout(10)
        assert client.recv(64) == b""  # the client sees the relay end
        assert not bridge.socket_path.exists()
    finally:
        client.close()
        for s in accepted:
            s.close()
        upstream.close()
