"""Which worker owns a session, and passing a request on to it (`polar gateway --workers N`).

A session's calls are numbered, chained and remembered by one process (`polar.gateway.sessions`), so with
several workers each session has an owner, `owner(session_id, n)`. A harness given its owner's base URL
calls it directly; a request that lands on another worker (a client that kept the shared port) is passed
to the owner as it came, bytes in and bytes out, streams included, and never served where it landed: two
processes serving one session would each number its calls. docs/gateway-workers.md has the design.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import aiohttp
import orjson

log = logging.getLogger("polar.gateway")

# Hop-by-hop headers (RFC 9110 7.6.1) and what aiohttp sets itself for the hop it makes.
_HOP = frozenset(
    (b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade", b"host", b"expect")
)


def owner(session_id: str, workers: int) -> int:
    """The worker that serves `session_id` among `workers`: a hash every process computes alike (Python's
    own `hash` of a str differs per process)."""
    return zlib.crc32(session_id.encode()) % workers


@dataclass(frozen=True)
class WorkerSet:
    """Where this process stands among the gateway's workers: its index, each worker's own model API (the
    URL this machine reaches it at, and the base URL a harness is given) and control listener."""

    index: int
    data_urls: tuple[str, ...]
    public_urls: tuple[str, ...]
    control_urls: tuple[str, ...]

    @property
    def n(self) -> int:
        return len(self.data_urls)

    def owner(self, session_id: str) -> int:
        return owner(session_id, self.n)


def request_key(scope: dict[str, Any]) -> str | None:
    """The session key of a raw ASGI request, where `polar.gateway.keys.session_key` finds it (Bearer,
    x-api-key, x-goog-api-key, ?key=), without building a Request."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    for wanted in (b"x-api-key", b"x-goog-api-key"):
        for name, value in headers:
            if name == wanted and value.strip():
                return value.decode("latin-1").strip()
    query: bytes = scope.get("query_string") or b""
    if b"key=" in query:
        for qname, qvalue in parse_qsl(query.decode("latin-1")):
            if qname == "key" and qvalue.strip():
                return qvalue.strip()
    return None


class Forwarder:
    """Passes raw ASGI requests to other workers over loopback, one pooled aiohttp session for all."""

    def __init__(self) -> None:
        self._http: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False,  # the answer's bytes go back as the owner sent them
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        return self._http

    async def __call__(self, base_url: str, scope: Any, receive: Any, send: Any) -> None:
        """Send the request in `scope`/`receive` to `base_url` and its answer back to `send`. An owner that
        cannot be reached gets a 503 JSON error: nothing was served, the harness retries."""
        target = base_url + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k not in _HOP]
        try:
            async with self._session().request(
                scope["method"], target, headers=headers, data=_body(receive), allow_redirects=False
            ) as answer:
                out = [(k, v) for k, v in answer.raw_headers if k.lower() not in _HOP]
                await send({"type": "http.response.start", "status": answer.status, "headers": out})
                async for chunk in answer.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            log.warning("could not reach the worker at %s: %s", base_url, exc)
            await _unavailable(send)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()


async def _body(receive: Any) -> AsyncIterator[bytes]:
    """The request body as it arrives (streamed on: the owner applies its own size and time limits)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def _unavailable(send: Any) -> None:
    body = orjson.dumps(
        {
            "type": "error",
            "error": {
                "message": "the gateway worker serving this session is not reachable (restarting?); retry",
                "type": "overloaded_error",
                "status": "UNAVAILABLE",
            },
        }
    )
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    try:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except Exception:  # the answer had started: the connection is dropped, the stream ends unfinished
        pass
