"""The gateway's ASGI applications: the data plane (dialect routes, model probes, health) and the control
plane (`polar.gateway.control`), each served on its own listener.

`create_app(config)` is the one entry point (used by `polar gateway`, nodes, tests and other parts of polar).
All state lives on the data app's `state`, created in its lifespan inside the serving event loop, and the
control app shares it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from polar import plugins
from polar.auth import Refusal, RequireToken
from polar.gateway import control
from polar.gateway.answers import error_response
from polar.gateway.backends import make_backend
from polar.gateway.backends.base import Backend
from polar.gateway.backends.openai import TokenDataMissing
from polar.gateway.backends.pool import BackendPool
from polar.gateway.backends.prompt_ids import MemoBudget
from polar.gateway.config import GatewayConfig
from polar.gateway.dialects.base import Dialect
from polar.gateway.dialects.gemini.routes import gemini, gemini_models, speaks_gemini
from polar.gateway.dialects.serving import Served, proxy_of
from polar.gateway.errors import GatewayError
from polar.gateway.forward import Forwarder, WorkerSet, request_key
from polar.gateway.metrics import GatewayMetrics
from polar.gateway.proxy import Proxy
from polar.gateway.routing import Classifiers
from polar.gateway.sessions import SessionRegistry, sweep_idle
from polar.gateway.signatures import ReasoningCodec
from polar.store.cache import SessionCache
from polar.store.sqlite import SQLiteStore
from polar.store.writer import AsyncWriter

log = logging.getLogger("polar.gateway")

# The dialects the data plane speaks, one package each exporting `SERVED` (`polar.gateway.dialects.serving`):
# a closed registry, as the runtimes are. Their order is the order in which they claim a request no route
# matched, for the shape of its error; chat claims the rest.
DIALECTS = plugins.Registry[Served](
    "dialect",
    {
        name: f"polar.gateway.dialects.{name}.routes:SERVED"
        for name in ("gemini", "anthropic", "responses", "chat")
    },
    closed=True,
)
SERVED: tuple[Served, ...] = tuple(DIALECTS.entries().values())


def dialect_for(request: Request) -> Dialect:
    """Which dialect's error shape fits a request we cannot route."""
    return next(served.dialect for served in SERVED if served.claims(request))


# -- model probes -----------------------------------------------------------------------------------------
def _model_entry(name: str, created: int) -> dict[str, Any]:
    # One object that both the OpenAI (id/object/owned_by) and Anthropic (type/display_name/created_at)
    # SDKs accept: each ignores the other's fields.
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "polar",
        "type": "model",
        "display_name": name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
    }


async def list_models(request: Request) -> Response:
    """`GET /v1/models`: the OpenAI/Anthropic listing, or Gemini's for a Gemini client (API version v1)."""
    if speaks_gemini(request):
        return await gemini_models(request)
    name = proxy_of(request).served_model
    entry = _model_entry(name, request.app.state.started)
    body = {"object": "list", "data": [entry], "has_more": False, "first_id": name, "last_id": name}
    return Response(orjson.dumps(body), media_type="application/json")


async def v1_model(request: Request) -> Response:
    """`/v1/models/{rest}`: Gemini's routes at API version v1 (every POST, and a GET from a Gemini client),
    else the OpenAI/Anthropic model lookup."""
    if request.method == "POST" or speaks_gemini(request):
        return await gemini(request)
    return Response(
        orjson.dumps(_model_entry(request.path_params["rest"], request.app.state.started)),
        media_type="application/json",
    )


async def root(request: Request) -> Response:
    # Claude Code sends `HEAD /` before its first call to check the base URL answers.
    return (
        Response(b"", status_code=200)
        if request.method == "HEAD"
        else Response(
            orjson.dumps({"service": "polar-gateway", "model": proxy_of(request).served_model}),
            media_type="application/json",
        )
    )


async def health(request: Request) -> Response:
    """Liveness for harnesses and probes; the backend, pause state and load are on the control listener."""
    body = {"status": "ok", "model": proxy_of(request).served_model}
    return Response(orjson.dumps(body), media_type="application/json")


# -- errors -----------------------------------------------------------------------------------------------
async def not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    if status == 405:
        err = GatewayError(
            "invalid_request", f"method {request.method} is not allowed on {request.url.path}", status=405
        )
    else:
        err = GatewayError("not_found", f"no route {request.method} {request.url.path}")
    return error_response(dialect_for(request), err)


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    err = GatewayError("upstream_error", "internal gateway error; the call was not completed", status=500)
    return error_response(dialect_for(request), err)


# -- assembly ---------------------------------------------------------------------------------------------
def _reasoning_key(config: GatewayConfig, store: SQLiteStore) -> bytes:
    """Signatures must outlive a gateway restart (a harness resends history), so the key lives in the store."""
    if config.reasoning_key is not None:
        return config.reasoning_key
    key = store.meta("reasoning_key")
    if key is None:
        key = secrets.token_bytes(32)
        store.set_meta("reasoning_key", key)
    return key


async def _first_model(backend: Backend) -> str:
    """The model the backend serves, for gateways started without `--model`."""
    try:
        models = await backend.list_models()
    except GatewayError as err:
        raise RuntimeError(f"could not list the backend's models ({err.message}); pass --model") from None
    if not models:
        raise RuntimeError(f"the backend at {backend.url} lists no model; pass --model")
    return models[0]


async def _check_token_data(backend: Backend, served: str) -> None:
    """Refuse to start in front of a server that answers without training data (`TokenDataMissing`).

    A server that cannot answer the check (not up yet in a cluster starting both at once, overloaded, or
    failing) is served with a warning: that is not a verdict on its token data, and records without token
    ids are flagged untrainable anyway."""
    try:
        await backend.check_token_data(served)
    except TokenDataMissing as exc:
        raise RuntimeError(str(exc)) from None
    except GatewayError as err:
        log.warning(
            "could not check that the %s server at %s returns token data (%s); records without token ids "
            "are flagged untrainable",
            backend.kind,
            backend.url,
            err.message,
        )


def _backend(config: GatewayConfig) -> Backend:
    """The client of the policy's server, or a pool when the gateway has several (`backends.pool`)."""
    if len(config.backend_urls) == 1:
        return make_backend(config.backend_kind, config.backend_url, config.backend)
    return BackendPool.of(
        config.backend_kind,
        config.backend_urls,
        config.backend,
        affinity=config.backend_affinity,
        health_interval_s=config.health_interval_s,
    )


async def _rendering(backend: Backend, served: str, config: GatewayConfig) -> Backend:
    """The client rendering prompts itself (`polar.gateway.render`); a clear error when it cannot."""
    from polar.gateway.render import TemplateUnusable, rendering

    try:
        return await rendering(backend, served, config.tokenizer, config.tool_parser, config.reasoning_parser)
    except TemplateUnusable as exc:
        raise RuntimeError(f"render: gateway: {exc}") from None
    except ImportError as exc:
        raise RuntimeError(
            f"render: gateway needs transformers for the model's tokenizer ({exc}): pip install 'polar-rl[engine]'"
        ) from None


class HotPath:
    """Serves the generation routes straight from ASGI, in front of Starlette's router and middleware.

    Those layers cost tens of microseconds per call, a large share of the gateway's budget at 1,000 calls/s
    on two cores; every other route still goes through Starlette. With several workers, a POST carrying the
    key of a session another worker owns is passed to that worker (`polar.gateway.forward`), whatever its
    route: only the owner numbers a session's calls.
    """

    def __init__(
        self,
        app: Starlette,
        workers: WorkerSet | None = None,
        forward: Forwarder | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.app = app
        self.state = app.state
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.routes = {path: endpoint for served in SERVED for path, endpoint in served.hot.items()}
        self.workers = workers if workers is not None and workers.n > 1 else None
        self.forward = forward if forward is not None else Forwarder()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.workers is not None and scope["type"] == "http" and scope["method"] == "POST":
            key = request_key(scope)
            if key is not None and (k := self.workers.owner(key)) != self.workers.index:
                self.metrics.passed_on += 1
                await self.forward(self.workers.data_urls[k], scope, receive, send)
                return
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        scope["app"] = self.app
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except Exception as exc:
            response = await internal_error(request, exc)
        await response(scope, receive, send)


@dataclass(frozen=True)
class GatewayApp:
    """The gateway's two planes over one proxy.

    `data` is the model API: the four dialects, model listing and probes. It is the only thing a session's
    sandbox can reach, and a session key opens model calls for that one session and nothing else. `control`
    holds sessions, records, trajectories and pause/resume, needs the control token on every route, and
    is served on a listener of its own (loopback by default) that no sandbox can reach. `data` runs the
    lifespan that opens the store and backend; serve `control` on the same event loop with lifespan off
    (`polar.serving.ServerThread(app.data, also=[app.control])`, or two `EmbeddedServer`s).
    """

    data: HotPath
    control: Any
    config: GatewayConfig

    @property
    def state(self) -> Any:
        return self.data.state


def control_app(
    state: Any,
    token: str,
    routes: Sequence[BaseRoute],
    on_refused: Refusal | None = None,
    around: Callable[[Any], Any] | None = None,
) -> Any:
    """A token-guarded Starlette app over `routes` sharing the gateway's `state` (its proxy and config);
    `around` wraps the app inside the token check (the workers' control router)."""
    app = Starlette(
        routes=list(routes),
        exception_handlers={
            404: control.not_found,
            405: control.not_found,
            Exception: control.internal_error,
        },
    )
    app.state = state
    return RequireToken(app if around is None else around(app), token, on_refused=on_refused)


def create_app(
    config: GatewayConfig, classifiers: Classifiers | None = None, workers: WorkerSet | None = None
) -> GatewayApp:
    """The gateway's two apps. `classifiers` builds a harness's side-call classifier for sessions that route
    side calls (`polar.gateway.routing`); without it such sessions are refused. `workers`: this process is
    one of several serving one store (`polar.cli.workers`): calls and control requests about sessions
    another worker owns go to it."""
    metrics = GatewayMetrics()
    forward = Forwarder()  # this gateway's own registry, served at the control listener's /metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        cache = SessionCache(config.session_cache_bytes, config.session_idle_s)
        # Commits on this loop, unless they wait for fsync (polar.store.writer).
        writer = AsyncWriter(config.store_path, config.durability, cache=cache)
        reader = SQLiteStore(config.store_path, config.durability)
        sweeper: asyncio.Task[None] | None = None
        backend = _backend(config)
        try:  # everything opened above is closed however start-up or serving ends
            await backend.start()
            if isinstance(backend, BackendPool):
                served = await backend.resolve_model(config.served_model)
            else:
                served = config.served_model or await _first_model(backend)
            if config.render == "gateway":
                backend = await _rendering(backend, served, config)
            if config.check_token_data:
                await _check_token_data(backend, served)
            app.state.config = config
            app.state.started = int(time.time())
            app.state.proxy = Proxy(
                backend=backend,
                served_model=served,
                sessions=SessionRegistry(
                    writer,
                    reader,
                    classifiers,
                    idle_s=config.session_idle_s,
                    memos=MemoBudget(config.prompt_memo_bytes),
                ),
                writer=writer,
                codec=ReasoningCodec(_reasoning_key(config, reader)),
                max_body_bytes=config.max_body_bytes,
                outbound=config.outbound,
                body_timeout_s=config.body_timeout_s,
                metrics=metrics,
            )
            every_s = min(60.0, config.session_idle_s / 2)
            sweeper = asyncio.create_task(sweep_idle(app.state.proxy.sessions, writer, every_s))
            log.info("gateway serving %s from %s backend at %s", served, backend.kind, backend.url)
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            proxy = getattr(app.state, "proxy", None)
            if proxy is not None:
                await proxy.aclose()  # the side-call backends it opened
            await forward.aclose()
            await backend.aclose()
            writer.close()
            reader.close()

    # The data plane: nothing here creates, lists, reads or steers sessions.
    routes = [
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{rest:path}", v1_model, methods=["GET", "POST"]),
        *(route for served in SERVED for route in served.routes),
    ]
    data = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_found, Exception: internal_error},
    )
    data.state.metrics_registry = metrics.registry
    data.state.workers = workers
    metrics.watch(lambda: getattr(data.state, "proxy", None))
    around = None
    if workers is not None and workers.n > 1:
        from polar.gateway.workers_control import ControlRouter

        def around(app: Any) -> Any:
            return ControlRouter(app, workers, forward)

    return GatewayApp(
        data=HotPath(data, workers, forward, metrics),
        control=control_app(data.state, config.control_token, control.routes, around=around),
        config=config,
    )
