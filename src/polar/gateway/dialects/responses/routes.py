"""OpenAI Responses: `POST /v1/responses`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar.gateway.dialects.responses.dialect import ResponsesDialect
from polar.gateway.dialects.serving import Served, proxy_of

RESPONSES = ResponsesDialect()


async def responses(request: Request) -> Response:
    return await proxy_of(request).call(RESPONSES, request)


def claims(request: Request) -> bool:
    return request.url.path.startswith("/v1/responses")


SERVED = Served(
    RESPONSES,
    routes=(Route("/v1/responses", responses, methods=["POST"]),),
    hot={"/v1/responses": responses},
    claims=claims,
)
