"""Anthropic Messages: `POST /v1/messages` and its token counter."""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar.gateway.answers import error_response, read_json
from polar.gateway.dialects.anthropic.dialect import AnthropicDialect
from polar.gateway.dialects.serving import Served, proxy_of
from polar.gateway.errors import GatewayError

ANTHROPIC = AnthropicDialect()


async def messages(request: Request) -> Response:
    return await proxy_of(request).call(ANTHROPIC, request)


async def count_tokens(request: Request) -> Response:
    """Anthropic's token counter, answered by the policy's own tokenizer (Claude Code calls it)."""
    proxy = proxy_of(request)
    try:
        proxy.authenticate(request)
        body = await read_json(request, proxy.max_body_bytes, proxy.body_timeout_s)
        req = ANTHROPIC.parse_count_tokens(body, proxy.codec)
        n = await proxy.backend.count_tokens(req, proxy.served_model)
    except GatewayError as err:
        return error_response(ANTHROPIC, err)
    return Response(orjson.dumps(ANTHROPIC.render_count_tokens(n)), media_type="application/json")


def claims(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


SERVED = Served(
    ANTHROPIC,
    routes=(
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ),
    hot={"/v1/messages": messages},
    claims=claims,
)
