"""The engine's HTTP app (Starlette, raw requests and orjson on the hot paths).

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `POST /tokenize`,
`POST /detokenize`, `GET /health`, `POST /update_weights`, `GET /policy_version`. Every failure is
answered in vLLM's error envelope; nothing a client sends can take the server down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from polar.chat.render import ChatTemplateError, render_chat
from polar.engine import serving_chat, serving_completion
from polar.engine.engine import Engine
from polar.engine.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UpdateWeightsRequest,
)
from polar.engine.serving_common import check_model, parse_body, token_text
from polar.engine.weights import WeightsError
from polar.jsontypes import JSON

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


def _json(obj: JSON, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _error(exc: APIError) -> Response:
    return _json(exc.body(), exc.status)


def _guard(handler: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            return _error(exc)
        except Exception:  # never a traceback on the wire
            log.exception("unhandled error in %s", request.url.path)
            return _error(APIError(500, "Internal server error"))

    return wrapped


def _sse(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_engine_app(engine: Engine, *, manage_engine: bool = False) -> Starlette:
    """An ASGI app serving `engine`; with `manage_engine` the app starts and stops its scheduler."""

    async def chat(request: Request) -> Response:
        req = parse_body(await request.body(), ChatCompletionRequest)
        job = serving_chat.prepare(engine, req)
        if req.stream:
            return _sse(serving_chat.stream(engine, job))
        return _json(await serving_chat.complete(engine, job))

    async def completions(request: Request) -> Response:
        req = parse_body(await request.body(), CompletionRequest)
        job = serving_completion.prepare(engine, req)
        if req.stream:
            return _sse(serving_completion.stream(engine, job))
        return _json(await serving_completion.complete(engine, job))

    async def models(request: Request) -> Response:
        card = {
            "id": engine.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "polar",
            "root": engine.loaded.source,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [],
            "policy_version": engine.policy_version,
        }
        # What a chat call without max_tokens gets: a gateway that renders (token ids in) asks for it.
        if engine.default_max_tokens:
            card["default_max_tokens"] = engine.default_max_tokens
        return _json({"object": "list", "data": [card]})

    async def tokenize(request: Request) -> Response:
        req = parse_body(await request.body(), TokenizeRequest)
        check_model(engine, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt or messages: give exactly one of them", param="prompt")
        if req.messages is not None:
            try:
                text = render_chat(
                    engine.tokenizer,
                    [m.model_dump() for m in req.messages],
                    tools=[t.model_dump() for t in req.tools] if req.tools else None,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    chat_template_kwargs=req.chat_template_kwargs,
                )
            except ChatTemplateError as exc:
                raise APIError(400, str(exc), param=exc.param) from exc
            special = bool(req.add_special_tokens)
        else:
            text = req.prompt or ""
            special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(engine.tokenizer.encode(text, add_special_tokens=special))
        names = token_text(engine)
        return _json(
            {
                "count": len(ids),
                "max_model_len": engine.max_model_len,
                "tokens": ids,
                "token_strs": [names(t) for t in ids] if req.return_token_strs else None,
            }
        )

    async def detokenize(request: Request) -> Response:
        req = parse_body(await request.body(), DetokenizeRequest)
        check_model(engine, req.model)
        vocab = len(engine.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})", param="tokens")
        return _json({"prompt": engine.tokenizer.decode(req.tokens)})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def policy_version(request: Request) -> Response:
        return _json({"policy_version": engine.policy_version})

    async def update_weights(request: Request) -> Response:
        req = parse_body(await request.body(), UpdateWeightsRequest)
        folder = req.folder()
        try:
            version = await asyncio.to_thread(engine.update_weights, folder, req.policy_version)
        except WeightsError as exc:
            raise APIError(400, f"path: {exc}", param="path") from exc
        return _json({"success": True, "message": f"loaded {folder}", "policy_version": version})

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        detail = exc.detail if isinstance(exc, HTTPException) else "Not Found"
        return _error(APIError(status, str(detail), kind="NotFoundError" if status == 404 else None))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                engine.stop()

    routes = [
        Route("/v1/chat/completions", _guard(chat), methods=["POST"]),
        Route("/v1/completions", _guard(completions), methods=["POST"]),
        Route("/v1/models", _guard(models), methods=["GET"]),
        Route("/tokenize", _guard(tokenize), methods=["POST"]),
        Route("/detokenize", _guard(detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/policy_version", policy_version, methods=["GET"]),
        Route("/update_weights", _guard(update_weights), methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: not_found})
