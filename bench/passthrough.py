"""The gateway's stack with none of the gateway: uvicorn (httptools, asyncio's loop) receiving a call and aiohttp
passing its bytes to the backend and the answer back, unparsed, unrecorded. bench/gateway_floor.py measures
it beside `polar gateway`: the CPU per call that any gateway built on these libraries pays.

    .venv/bin/python bench/passthrough.py --backend http://127.0.0.1:8000 --port 8100
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import uvicorn

Scope = dict[str, Any]


class Passthrough:
    """An ASGI app forwarding every POST to the same path on `backend` (one pooled aiohttp session)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend.rstrip("/")
        self.http: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.http is None:
            self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        headers = {"content-type": "application/json"}
        async with self.http.post(self.backend + scope["path"], data=body, headers=headers) as r:
            status, answer = r.status, await r.read()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": answer})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(
        Passthrough(args.backend),
        host="127.0.0.1",
        port=args.port,
        loop="asyncio",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
