"""Tests run servers with the product's own helper; re-exported here for the fakes and fixtures."""

from typing import Any

from polar.serving import ServerThread, free_port, serve

__all__ = ["ServerThread", "free_port", "lifespan", "read_body", "serve"]


async def lifespan(receive: Any, send: Any) -> None:
    """Answer an ASGI lifespan scope: nothing to start or stop."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive: Any) -> bytes:
    """An ASGI request's whole body."""
    raw = b""
    more = True
    while more:
        msg = await receive()
        raw += msg.get("body", b"")
        more = msg.get("more_body", False)
    return raw
