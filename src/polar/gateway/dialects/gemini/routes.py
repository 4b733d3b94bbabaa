"""Google Gemini: `/v1beta/models/{model}:{method}` (generateContent, streamGenerateContent, countTokens)
and its model listing; the same routes at API version `v1` are told apart from OpenAI's and Anthropic's
`/v1/models` by `speaks_gemini` (`polar.gateway.app`'s model probes)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar.gateway.answers import error_response, read_json
from polar.gateway.dialects.base import StreamFormat
from polar.gateway.dialects.gemini.dialect import GeminiDialect
from polar.gateway.dialects.serving import Served, proxy_of
from polar.gateway.errors import GatewayError

GEMINI = GeminiDialect()

_METHODS = (":generateContent", ":streamGenerateContent", ":countTokens")


def speaks_gemini(request: Request) -> bool:
    """Whether a request is Google's Gemini API. Its model routes exist under `/v1beta` and, since the
    google-genai SDK's default moved to API version `v1`, under `/v1` too, where `/v1/models` is also the
    OpenAI and Anthropic listing: a Gemini method in the path, Google's key header or client header, or a
    `?key=` tells them apart (the openai and anthropic SDKs send none of these)."""
    path = request.url.path
    return (
        path.startswith("/v1beta")
        or path.endswith(_METHODS)
        or "x-goog-api-key" in request.headers
        or "x-goog-api-client" in request.headers
        or "key" in request.query_params
    )


async def gemini(request: Request) -> Response:
    """`/v1beta/models/{model}:{method}` (or `/v1/...`): generateContent, streamGenerateContent, countTokens;
    a GET without a method is Gemini's model lookup."""
    rest: str = request.path_params["rest"]
    model, sep, method = rest.rpartition(":")
    if not sep:
        if request.method == "GET":
            return await gemini_model(request)
        return error_response(GEMINI, GatewayError("not_found", f"no route POST {request.url.path}"))
    proxy = proxy_of(request)
    if method == "generateContent":
        return await proxy.call(GEMINI, request, path_model=model, path_stream=False)
    if method == "streamGenerateContent":
        fmt: StreamFormat = "sse" if request.query_params.get("alt") == "sse" else "json-array"
        return await proxy.call(GEMINI, request, path_model=model, path_stream=True, stream_format=fmt)
    if method == "countTokens":
        try:
            proxy.authenticate(request)
            body = await read_json(request, proxy.max_body_bytes, proxy.body_timeout_s)
            # countTokens takes either a bare `contents` list or a whole `generateContentRequest`.
            if isinstance(body, dict) and isinstance(body.get("generateContentRequest"), dict):
                body = body["generateContentRequest"]
            req = GEMINI.parse(body, proxy.codec, path_model=model, path_stream=False)
            n = await proxy.backend.count_tokens(req, proxy.served_model)
        except GatewayError as err:
            return error_response(GEMINI, err)
        return Response(orjson.dumps({"totalTokens": n}), media_type="application/json")
    unknown = GatewayError(
        "not_found",
        f"unknown method {method!r}; supported: generateContent, streamGenerateContent, countTokens",
    )
    return error_response(GEMINI, unknown)


def _model(name: str) -> dict[str, Any]:
    return {
        "name": f"models/{name}",
        "baseModelId": name,
        "version": "polar",
        "displayName": name,
        "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"],
    }


async def gemini_models(request: Request) -> Response:
    body = {"models": [_model(proxy_of(request).served_model)]}
    return Response(orjson.dumps(body), media_type="application/json")


async def gemini_model(request: Request) -> Response:
    name = request.path_params["rest"].removeprefix("models/")
    return Response(orjson.dumps(_model(name)), media_type="application/json")


SERVED = Served(
    GEMINI,
    routes=(
        Route("/v1beta/models", gemini_models, methods=["GET"]),
        Route("/v1beta/models/{rest:path}", gemini, methods=["GET", "POST"]),
    ),
    claims=speaks_gemini,
)
