"""What a dialect package serves, as data: its routes (starlette's `Route`s), the POST paths the gateway
answers ahead of Starlette's router (`polar.gateway.app.HotPath`), and which requests it claims when no
route matched and an error must be answered in some dialect's shape.

A new dialect is a package beside `chat`, `responses`, `anthropic` and `gemini` whose `routes` module exports
`SERVED`, plus its name in `polar.gateway.app.DIALECTS`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, cast

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar.gateway.backends.base import Backend
from polar.gateway.dialects.base import Dialect, StreamFormat
from polar.gateway.sessions import SessionState
from polar.gateway.signatures import ReasoningCodec

Endpoint = Callable[[Request], Awaitable[Response]]


class Serving(Protocol):
    """What a dialect's routes use of the gateway's proxy (`polar.gateway.proxy.Proxy` is one)."""

    backend: Backend
    served_model: str
    codec: ReasoningCodec
    max_body_bytes: int
    body_timeout_s: float

    def authenticate(self, request: Request) -> SessionState: ...

    async def call(
        self,
        dialect: Dialect,
        request: Request,
        *,
        path_model: str | None = None,
        path_stream: bool | None = None,
        stream_format: StreamFormat = "sse",
    ) -> Response: ...


def proxy_of(request: Request) -> Serving:
    """The gateway's proxy, made in its lifespan (`polar.gateway.app.create_app`)."""
    return cast(Serving, request.app.state.proxy)


def always(request: Request) -> bool:
    return True


@dataclass(frozen=True)
class Served:
    dialect: Dialect
    routes: tuple[Route, ...]
    hot: Mapping[str, Endpoint] = field(default_factory=dict)  # POST path -> endpoint, ahead of the router
    claims: Callable[[Request], bool] = always  # the error shape for a request no route matched
