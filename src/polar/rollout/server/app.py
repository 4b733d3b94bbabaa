"""The rollout server's HTTP routes (`polar serve`). Behaviour lives in `service`; here requests are read,
validated and answered. Every error is JSON `{"error": {"message", "type", "param"}}` with a 4xx naming
the field, never a traceback.

Trainers:   POST   /rollout/task/submit      Task | [Task] | {"tasks": [...]} -> 201 {"tasks": [{task_id, session_ids}]}
            GET    /rollout/task/{id}        state, counts, sessions, callbacks, results (?results=false: without)
            DELETE /rollout/task/{id}        cancel -> {"cancelled": bool, "state"}
            GET    /rollout/results          ?task=A&task=B&after=N&wait=S: long poll for finished sessions
            GET    /rollout/status           tasks by state, sessions by status, node capacity, judge_group phases
            GET    /events                   SSE (?kinds=a,b to filter)
Operators:  GET    /metrics                  Prometheus (docs/prometheus.md)
            POST   /nodes/{id}/drain         DrainRequest (optional) -> 202: the node drains, then leaves
            POST   /nodes/{id}/lost          {"reason"}: the node is dead; its open sessions end ERROR now
Browsers:   GET    /ui/...                   the dashboard, when served with it (`polar.dashboard.server_app`)
Nodes:      POST   /nodes/register, POST /nodes/{id}/heartbeat, POST /callbacks/session_result,
            POST   /nodes/{id}/leave (409 while sessions are open on it)
            GET    /nodes
Submitters: POST   /images/where             ImagesQuery -> which live nodes hold or fetch each image
Anyone:     GET    /health

Every route but /health needs the deployment's control token (`polar.auth`); refusals are counted and
shown under `security` in `/rollout/status`. A session result is accepted only with the credential of that
session's dispatch (`x-polar-result-token`), i.e. from the node it was dispatched to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Scope

from polar.auth import RequireToken
from polar.jsontypes import JSON
from polar.limits import BodyError, format_path, json_error, nesting_message, nesting_path, read_body
from polar.metrics import metrics_endpoint
from polar.rollout.protocol import (
    RESULT_TOKEN_HEADER,
    DrainRequest,
    ImagesQuery,
    NodeRegistration,
    NodeStatus,
    SessionResult,
)
from polar.rollout.server.config import ServerConfig
from polar.rollout.server.events import sse_stream
from polar.rollout.server.metrics import server_registry
from polar.rollout.server.scheduler import is_healthy
from polar.rollout.server.security import client_of
from polar.rollout.server.service import RolloutService
from polar.rollout.server.validate import SubmitError, check_outbound, check_task
from polar.task import Task

log = logging.getLogger("polar.server")
M = TypeVar("M", bound=BaseModel)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or ("not_found" if status == 404 else "invalid_request")


def _json(body: JSON, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(err: HTTPError) -> Response:
    response = _json({"error": {"message": err.message, "type": err.type, "param": err.param}}, err.status)
    if err.status == 408:  # the rest of the body may still come: it must not be read as the next request
        response.headers["connection"] = "close"
    return response


def _svc(request: Request) -> RolloutService:
    svc: RolloutService = request.app.state.service
    return svc


def _loc(loc: tuple[Any, ...], prefix: str = "") -> str:
    out = prefix
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


async def _body(request: Request) -> JSON:
    """The JSON body, read within the configured time and size and nested at most `MAX_JSON_DEPTH` deep
    (a task's `metadata` and its agent's `settings` are free-form, and are stored and sent on)."""
    config = _svc(request).config
    try:
        data = await read_body(request, config.max_body_bytes, config.body_timeout_s)
    except BodyError as exc:
        raise HTTPError(exc.status, exc.message) from None
    if not data:
        raise HTTPError(400, "empty body; expected JSON")
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, json_error(exc)) from None
    path = nesting_path(body)
    if path is not None:
        raise HTTPError(400, nesting_message(path), format_path(path))
    return body


def _model(cls: type[M], data: JSON, prefix: str = "") -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = _loc(tuple(err["loc"]), prefix) or None
        raise HTTPError(400, f"{param or cls.__name__}: {err['msg']}", param) from None


def route(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def wrapper(request: Request) -> Response:
        try:
            result: Response = await handler(request)
            return result
        except HTTPError as err:
            return _error(err)

    return wrapper


# -- tasks ------------------------------------------------------------------------------------------------
@route
async def submit(request: Request) -> Response:
    """A Task, a list of Tasks, or {"tasks": [...]}; all are validated before any is stored."""
    body = await _body(request)
    if isinstance(body, dict) and "tasks" in body:
        items, prefix = body["tasks"], "tasks"
    elif isinstance(body, list):
        items, prefix = body, ""
    else:
        items, prefix = [body], None
    if not isinstance(items, list) or not items:
        raise HTTPError(400, "tasks must be a non-empty list", "tasks")
    tasks: list[Task] = []
    located: list[tuple[Task, str]] = []
    for i, item in enumerate(items):
        where = "" if prefix is None else f"{prefix}[{i}]"
        task = _model(Task, item, where)
        try:
            check_task(task, f"{where}." if where else "")
        except SubmitError as err:
            raise HTTPError(400, err.message, err.param) from None
        tasks.append(task)
        located.append((task, f"{where}." if where else ""))
    try:
        await check_outbound(located, _svc(request).config.outbound)
    except SubmitError as err:
        raise HTTPError(400, err.message, err.param) from None
    ids = [t.task_id for t in tasks]
    dupes = sorted({t for t in ids if ids.count(t) > 1})
    if dupes:
        raise HTTPError(400, f"duplicate task_id in one submission: {', '.join(dupes)}", "task_id")
    try:
        created = _svc(request).submit(tasks)
    except KeyError as exc:
        raise HTTPError(
            409, f"task {exc.args[0]} was already submitted; task ids are unique", "task_id"
        ) from None
    return _json({"tasks": created}, 201)


def _task_view(svc: RolloutService, task_id: str, with_results: bool) -> dict[str, Any]:
    row = svc.store.task(task_id)
    if row is None:
        raise HTTPError(404, f"no task {task_id}", "task_id")
    sessions = svc.store.sessions_of(task_id)
    view: dict[str, Any] = {
        "task_id": task_id,
        "state": row.state,
        "reason": row.reason,
        "submitted_at": row.submitted_at,
        "finished_at": row.finished_at,
        "num_samples": row.task.num_samples,
        "counts": svc.store.counts(task_id),
        "sessions": [
            {
                "session_id": s.session_id,
                "sample_index": s.sample_index,
                "status": s.status.value,
                "node_id": s.node_id,
                "reason": s.reason,
            }
            for s in sessions
        ],
        "callbacks": [
            {"session_id": c.session_id, "state": c.state, "attempts": c.attempts, "last_error": c.last_error}
            for c in svc.store.callbacks(task_id)
        ],
    }
    if with_results:
        view["results"] = [orjson.Fragment(blob) for _, blob in svc.store.results([task_id], 0, 1 << 30)]
    return view


@route
async def get_task(request: Request) -> Response:
    with_results = request.query_params.get("results", "true").lower() not in ("0", "false", "no")
    return _json(_task_view(_svc(request), request.path_params["task_id"], with_results))


@route
async def cancel_task(request: Request) -> Response:
    task_id = request.path_params["task_id"]
    svc = _svc(request)
    try:
        cancelled = svc.cancel(task_id)
    except KeyError:
        raise HTTPError(404, f"no task {task_id}", "task_id") from None
    row = svc.store.task(task_id)
    assert row is not None
    return _json({"task_id": task_id, "cancelled": cancelled, "state": row.state})


def _float_param(request: Request, name: str, default: float, lo: float, hi: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise HTTPError(400, f"{name} must be a number, not {raw!r}", name) from None
    if not lo <= value <= hi:
        raise HTTPError(400, f"{name} must be between {lo:g} and {hi:g}", name)
    return value


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the request's body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@route
async def results(request: Request) -> Response:
    """Long poll: `?task=A&task=B&after=N&wait=S[&limit=L]` answers finished sessions past sequence N as
    soon as there are any (or after S seconds with none). `next` is the cursor for the following call."""
    svc = _svc(request)
    task_ids = request.query_params.getlist("task")
    if not task_ids:
        raise HTTPError(400, "name at least one task: ?task=ID", "task")
    unknown = [t for t in task_ids if svc.store.task(t) is None]
    if unknown:
        raise HTTPError(404, f"no task {', '.join(unknown)}", "task")
    after = int(_float_param(request, "after", 0, 0, 1e18))
    wait = _float_param(request, "wait", 0, 0, 300)
    # Results carry whole trajectories (megabytes each): pages stay small, the cursor fetches the rest.
    limit = int(_float_param(request, "limit", 64, 1, 1000))
    poll = asyncio.ensure_future(svc.wait_results(task_ids, after, wait, limit))
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({poll, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not poll.done():
        # The client went away (a trainer or `polar run` interrupted): the poll ends now instead of holding
        # the server's shutdown for up to `wait` seconds. Nothing is consumed: results stay at their cursor.
        poll.cancel()
        return Response(status_code=204)
    rows = poll.result()
    states = {t: (r.state if (r := svc.store.task(t)) else "UNKNOWN") for t in task_ids}
    return _json(
        {
            "results": [orjson.Fragment(blob) for _, blob in rows],
            "next": rows[-1][0] if rows else after,
            "tasks": states,
        }
    )


@route
async def rollout_status(request: Request) -> Response:
    svc = _svc(request)
    views = svc.node_views()
    return _json(
        {
            "tasks": svc.store.task_states(),
            "sessions": svc.store.counts(),
            "nodes": {
                "total": len(views),
                "healthy": sum(v.healthy and not v.lost for v in views),
                "capacity": sum(v.capacity for v in views if v.healthy and not v.lost),
                "load": sum(v.load for v in views),
            },
            "groups": svc.groups_view(),
            "security": svc.security.view(),
        }
    )


# -- nodes ------------------------------------------------------------------------------------------------
@route
async def session_result(request: Request) -> Response:
    result = _model(SessionResult, await _body(request))
    token = request.headers.get(RESULT_TOKEN_HEADER)
    outcome = _svc(request).report(result, token, client_of(request.scope))
    if outcome == "refused":
        raise HTTPError(
            403,
            f"result for {result.session_id} refused: it does not carry the credential of that session's "
            "dispatch, so it is not from the node the session was dispatched to",
            RESULT_TOKEN_HEADER,
            "permission_error",
        )
    if outcome == "unknown":
        raise HTTPError(404, f"no session {result.session_id}", "session_id")
    if outcome == "mismatch":
        raise HTTPError(
            409, f"session {result.session_id} does not belong to task {result.task_id}", "task_id"
        )
    return _json({"ack": True, "outcome": outcome})


@route
async def register_node(request: Request) -> Response:
    reg = _model(NodeRegistration, await _body(request))
    if not reg.url.startswith(("http://", "https://")):
        raise HTTPError(400, f"url must be an http(s) URL, not {reg.url!r}", "url")
    server_url = str(request.base_url).rstrip("/")  # how this node reaches us
    _svc(request).register_node(reg.node_id, reg.url, reg.capacity, server_url)
    return _json({"node_id": reg.node_id})


@route
async def heartbeat(request: Request) -> Response:
    node_id = request.path_params["node_id"]
    status = _model(NodeStatus, await _body(request))
    if status.node_id != node_id:
        raise HTTPError(400, f"node_id {status.node_id!r} does not match the path ({node_id!r})", "node_id")
    if status.capacity < 1:
        raise HTTPError(400, "capacity must be at least 1", "capacity")
    reply = _svc(request).heartbeat(node_id, status)
    if reply is None:
        raise HTTPError(404, f"no node {node_id}; register first (POST /nodes/register)", "node_id")
    return _json(reply.model_dump(mode="json"))


async def _small_json(request: Request, what: str) -> JSON:
    """The JSON body of an operator's node request (at most 64 KiB; empty means {}), or a 4xx naming it."""
    try:
        raw = await read_body(request, 64 << 10, _svc(request).config.body_timeout_s)
        return orjson.loads(raw) if raw.strip() else {}
    except BodyError as exc:
        raise HTTPError(exc.status, f"{what} request: {exc.message}") from None
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"{what} request: {json_error(exc)}") from None


@route
async def drain_node(request: Request) -> Response:
    """Operators (`polar node drain ID`): the server stops placing sessions there at once and forwards."""
    node_id = request.path_params["node_id"]
    data = await _small_json(request, "drain")
    drain = _model(DrainRequest, data)
    try:
        status = await _svc(request).drain_node(node_id, drain)
    except KeyError:
        raise HTTPError(404, f"no node {node_id}", "node_id") from None
    except RuntimeError as exc:
        raise HTTPError(502, str(exc), type_="node_error") from None
    return _json(
        {"node_id": node_id, "draining": status.draining, "status": status.model_dump(mode="json")}, 202
    )


@route
async def node_lost(request: Request) -> Response:
    """Operators and cluster managers (`polar serve --ray` when Ray reports a node dead): the node's open
    sessions end ERROR "node lost" now, not after `node_lost_after_s` of silence."""
    node_id = request.path_params["node_id"]
    data = await _small_json(request, "lost")
    reason = data.get("reason") if isinstance(data, dict) else None
    if reason is None:
        reason = "reported dead"
    if not isinstance(reason, str) or not 0 < len(reason) <= 1000:
        raise HTTPError(400, "reason must be a string of 1 to 1000 characters", "reason")
    ended = _svc(request).node_gone(node_id, reason)
    if ended is None:
        raise HTTPError(404, f"no node {node_id}", "node_id")
    return _json({"node_id": node_id, "lost": True, "sessions_ended": ended})


@route
async def leave_node(request: Request) -> Response:
    node_id = request.path_params["node_id"]
    open_ = _svc(request).leave_node(node_id)
    if open_ is None:
        raise HTTPError(404, f"no node {node_id}", "node_id")
    if open_:
        raise HTTPError(409, f"node {node_id} still has {open_} open session(s) here", "node_id")
    return _json({"node_id": node_id, "left": True})


@route
async def list_nodes(request: Request) -> Response:
    svc = _svc(request)
    now = time.time()
    load = {v.node_id: v for v in svc.node_views(now)}
    out = []
    for n in svc.store.nodes():
        out.append(
            {
                "node_id": n.node_id,
                "url": n.url,
                "capacity": n.capacity,
                "load": load[n.node_id].load if n.node_id in load else 0,
                "healthy": is_healthy(n.last_heartbeat, now, svc.config.heartbeat_timeout_s) and not n.lost,
                "draining": n.draining,
                "lost": n.lost,
                "last_heartbeat_s_ago": round(now - n.last_heartbeat, 3),
                "status": n.status,
                "images": len(load[n.node_id].images) if n.node_id in load else 0,
                "prefetching": [list(i) for i in svc.dispatcher.prefetching.get(n.node_id, [])],
                "auth_error": svc.dispatcher.auth_errors.get(n.node_id),
            }
        )
    return _json({"nodes": out})


@route
async def images_where(request: Request) -> Response:
    """Which live nodes hold each image (`polar submit` checks before it submits)."""
    query = _model(ImagesQuery, await _body(request))
    return _json(_svc(request).dispatcher.where(query.images))


async def health(request: Request) -> Response:
    return _json({"status": "ok", "service": "polar-rollout-server"})


async def events(request: Request) -> Response:
    bus = _svc(request).events
    kinds_q = request.query_params.get("kinds")
    kinds = frozenset(k for k in kinds_q.split(",") if k) if kinds_q else None
    sub = bus.subscribe(kinds)
    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(sse_stream(bus, sub), media_type="text/event-stream", headers=headers)


async def not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    if status == 405:
        return _error(HTTPError(405, f"method {request.method} is not allowed on {request.url.path}"))
    return _error(HTTPError(404, f"no route {request.method} {request.url.path}"))


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(HTTPError(500, "internal server error", type_="server_error"))


class Front(Protocol):
    """What serves beside the server's API on its listener: the dashboard (`polar.dashboard.server_app`
    puts the two together; the server imports nothing of it). `wrap` gets the token-guarded API, the token,
    the live service (None outside the server's lifespan) and the hook that logs a refused request, and
    returns the app to serve; `aclose` runs when the server stops."""

    def wrap(
        self,
        api: ASGIApp,
        token: str,
        service: Callable[[], RolloutService | None],
        refused: Callable[[Scope, str], None],
    ) -> ASGIApp: ...

    async def aclose(self) -> None: ...


def create_app(config: ServerConfig, front: Front | None = None) -> ASGIApp:
    """The server's ASGI app: control routes behind the token, and `front` (the dashboard) beside them."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service = RolloutService(config)
        app.state.service = service
        service.start()
        log.info("rollout server state in %s", config.db_path)
        try:
            yield
        finally:
            if front is not None:
                await front.aclose()
            await service.aclose()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/events", events, methods=["GET"]),
        Route("/rollout/task/submit", submit, methods=["POST"]),
        Route("/rollout/task/{task_id:path}", get_task, methods=["GET"]),
        Route("/rollout/task/{task_id:path}", cancel_task, methods=["DELETE"]),
        Route("/rollout/results", results, methods=["GET"]),
        Route("/rollout/status", rollout_status, methods=["GET"]),
        Route("/callbacks/session_result", session_result, methods=["POST"]),
        Route("/nodes/register", register_node, methods=["POST"]),
        Route("/nodes/{node_id}/heartbeat", heartbeat, methods=["POST"]),
        Route("/nodes/{node_id}/drain", drain_node, methods=["POST"]),
        Route("/nodes/{node_id}/leave", leave_node, methods=["POST"]),
        Route("/nodes/{node_id}/lost", node_lost, methods=["POST"]),
        Route("/nodes", list_nodes, methods=["GET"]),
        Route("/images/where", images_where, methods=["POST"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),  # Prometheus (polar.rollout.server.metrics)
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_found, Exception: internal_error},
    )
    app.state.metrics_registry = server_registry(lambda: getattr(app.state, "service", None))

    def refused(scope: Scope, why: str) -> None:
        service: RolloutService | None = getattr(app.state, "service", None)
        if service is not None:
            service.security.refused_auth(client_of(scope), scope["method"], scope["path"], why)
            log.warning("refused %s %s from %s: %s", scope["method"], scope["path"], client_of(scope), why)

    api = RequireToken(app, config.token, on_refused=refused)
    if front is None:
        return api
    return front.wrap(api, config.token, lambda: getattr(app.state, "service", None), refused)
