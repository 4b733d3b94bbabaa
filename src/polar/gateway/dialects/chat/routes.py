"""OpenAI Chat Completions: `POST /v1/chat/completions`. It claims every request no other dialect does."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar.gateway.dialects.chat.dialect import ChatDialect
from polar.gateway.dialects.serving import Served, proxy_of

CHAT = ChatDialect()


async def chat_completions(request: Request) -> Response:
    return await proxy_of(request).call(CHAT, request)


SERVED = Served(
    CHAT,
    routes=(Route("/v1/chat/completions", chat_completions, methods=["POST"]),),
    hot={"/v1/chat/completions": chat_completions},
)
