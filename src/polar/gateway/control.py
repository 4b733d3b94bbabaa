"""The control plane: sessions, their records and trajectories, the weight-sync gate, and `/metrics`.

Served on the gateway's control listener, never on the model API a session reaches; every route needs the
control token (`polar.auth.RequireToken` wraps the app), which a harness's session key is not.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar.gateway.answers import read_json
from polar.gateway.errors import GatewayError
from polar.gateway.proxy import Proxy
from polar.jsontypes import JSON
from polar.metrics import metrics_endpoint
from polar.store.sqlite import SQLiteStore

log = logging.getLogger("polar.gateway")
T = TypeVar("T")


def _json(body: JSON, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(status: int, message: str, type_: str = "invalid_request_error") -> Response:
    return _json({"error": {"message": message, "type": type_}}, status)


def _proxy(request: Request) -> Proxy:
    proxy: Proxy = request.app.state.proxy
    return proxy


async def _read_store(request: Request, fn: Callable[[SQLiteStore], T]) -> T:
    """Run a read on a fresh connection in a worker thread: reads never block the event loop or writer."""
    path = request.app.state.config.store_path

    def work() -> T:
        with SQLiteStore(path) as store:
            return fn(store)

    return await asyncio.to_thread(work)


async def create_session(request: Request) -> Response:
    metadata: dict[str, Any] = {}
    if request.headers.get("content-length") not in (None, "0"):
        try:
            body = await read_json(request, 1 << 20)
        except GatewayError as err:
            return _error(err.status, err.message)
        if not isinstance(body, dict):
            return _error(400, 'body must be a JSON object, e.g. {"task_id": "t1"}')
        metadata = body.get("metadata", {})
        if not isinstance(metadata, dict):
            return _error(400, "metadata must be a JSON object")
        metadata = {**{k: v for k, v in body.items() if k not in ("metadata", "session_id")}, **metadata}
        requested = body.get("session_id")
        if requested is not None and (not isinstance(requested, str) or not 8 <= len(requested) <= 128):
            return _error(400, "session_id must be a string of 8 to 128 characters")
    else:
        requested = None
    try:
        state = await _proxy(request).sessions.create(metadata, requested)
    except KeyError:
        return _error(409, f"session {requested} already exists; session ids are single-use")
    except ValueError as exc:  # a malformed side_call_route (polar.gateway.routing)
        return _error(400, f"metadata.{exc}")
    answer: dict[str, Any] = {
        "session_id": state.session_id,
        "created_at": state.created_at,
        "metadata": metadata,
    }
    workers = getattr(request.app.state, "workers", None)
    if workers is not None and workers.n > 1:  # its owner's own model API: no hop between workers
        answer["base_url"] = workers.public_urls[workers.owner(state.session_id)]
    return _json(answer, 201)


async def get_session(request: Request) -> Response:
    sid = request.path_params["session_id"]
    state = _proxy(request).sessions.get(sid)
    if state is None:
        return _error(404, f"no session {sid}", "not_found_error")
    return _json(
        {
            "session_id": sid,
            "status": "closed" if state.closed else "open",
            "created_at": state.created_at,
            "metadata": state.metadata,
            "completions": state.counts["completions"],
            "failures": state.counts["failures"],
            "calls": state.next_seq,
        }
    )


def _records_of(kind: str) -> Callable[[Request], Awaitable[Response]]:
    """`GET /sessions/{id}/completions` and `/failures`: the session's records of that kind, in call order."""

    async def handler(request: Request) -> Response:
        sid = request.path_params["session_id"]
        if _proxy(request).sessions.get(sid) is None:
            return _error(404, f"no session {sid}", "not_found_error")
        records = await _read_store(request, lambda s: getattr(s, kind)(sid))
        return _json({"session_id": sid, kind: [r.to_json() for r in records]})

    return handler


list_completions = _records_of("completions")
list_failures = _records_of("failures")


async def get_trajectory(request: Request) -> Response:
    from polar.trajectory import build, builders

    sid = request.path_params["session_id"]
    if _proxy(request).sessions.get(sid) is None:
        return _error(404, f"no session {sid}", "not_found_error")
    strategy = request.query_params.get("strategy", "prefix_merging")
    if strategy not in builders():  # import paths are not taken from the network
        return _error(400, f"unknown strategy {strategy!r}; choose one of {', '.join(builders())}")
    records = await _read_store(request, lambda s: s.completions(sid))
    trajectory = await asyncio.to_thread(build, records, strategy=strategy)
    return Response(trajectory.model_dump_json(), media_type="application/json")


async def delete_session(request: Request) -> Response:
    sid = request.path_params["session_id"]
    if not await _proxy(request).close_session(sid):
        return _error(404, f"no session {sid}", "not_found_error")
    return _json({"session_id": sid, "status": "closed"})


async def pause(request: Request) -> Response:
    """Stop admitting generations and wait for those in flight (weight sync). `?timeout=` seconds."""
    raw = request.query_params.get("timeout")
    try:
        timeout = float(raw) if raw is not None else None
    except ValueError:
        return _error(400, "timeout must be a number of seconds")
    gate = _proxy(request).gate
    drained = await gate.pause(timeout)
    return _json({"paused": True, "drained": drained, "in_flight": gate.in_flight})


async def resume(request: Request) -> Response:
    """Admit generations again; `?policy_version=N` names the weights now served, recorded on every call
    that starts generating from here on (for servers that report no version themselves, like vLLM)."""
    raw = request.query_params.get("policy_version")
    version: int | None = None
    if raw is not None:
        try:
            version = int(raw)
        except ValueError:
            return _error(400, f"policy_version must be an integer, not {raw!r}")
    _proxy(request).gate.resume(version)
    return _json({"paused": False, "policy_version": _proxy(request).gate.policy_version})


async def health(request: Request) -> Response:
    """The gateway's state for operators: model, backend, pause and load."""
    proxy = _proxy(request)
    body = {
        "status": "ok",
        "model": proxy.served_model,
        "backend": {"kind": proxy.backend.kind, "url": proxy.backend.url},
        "paused": proxy.gate.paused,
        "in_flight": proxy.gate.in_flight,
    }
    workers = getattr(request.app.state, "workers", None)
    if workers is not None and workers.n > 1:
        body["worker"], body["pid"] = workers.index, os.getpid()
    return _json(body)


async def backends(request: Request) -> Response:
    """Per-server state (URL, health, calls in flight, calls, failures, pinned sessions): internal
    addresses, so only here, behind the token, never on the model API or the open `/health`."""
    proxy = _proxy(request)
    if proxy.pool is None:
        servers: list[dict[str, Any]] = [{"url": proxy.backend.url, "outstanding": proxy.gate.in_flight}]
        return _json({"kind": proxy.backend.kind, "affinity": None, "backends": servers})
    return _json({"kind": proxy.pool.kind, "affinity": proxy.pool.affinity, "backends": proxy.pool.state()})


async def set_backend(request: Request) -> Response:
    """`POST /admin/backends {"url": U, "enabled": false}`: take a server out of rotation (a weight sync
    failed on it) or put it back; health checks do not override it."""
    try:
        body = await read_json(request, 1 << 16)
    except GatewayError as err:
        return _error(err.status, err.message)
    url = body.get("url") if isinstance(body, dict) else None
    enabled = body.get("enabled") if isinstance(body, dict) else None
    if not isinstance(url, str) or not isinstance(enabled, bool):
        return _error(400, 'body must be {"url": "http://...", "enabled": true|false}')
    pool = _proxy(request).pool
    if pool is None:
        return _error(409, "this gateway has one inference server; there is no rotation to change")
    if not pool.set_enabled(url, enabled):
        return _error(404, f"no inference server {url} behind this gateway", "not_found_error")
    return _json({"backends": pool.state()})


async def not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    if status == 405:
        return _error(405, f"method {request.method} is not allowed on {request.url.path}")
    return _error(404, f"no route {request.method} {request.url.path}", "not_found_error")


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(500, "internal error; see the gateway's log", "api_error")


routes = [
    Route("/health", health, methods=["GET"]),
    Route("/sessions", create_session, methods=["POST"]),
    Route("/sessions/{session_id}", get_session, methods=["GET"]),
    Route("/sessions/{session_id}", delete_session, methods=["DELETE"]),
    Route("/sessions/{session_id}/completions", list_completions, methods=["GET"]),
    Route("/sessions/{session_id}/failures", list_failures, methods=["GET"]),
    Route("/sessions/{session_id}/trajectory", get_trajectory, methods=["GET"]),
    Route("/admin/pause", pause, methods=["POST"]),
    Route("/admin/resume", resume, methods=["POST"]),
    Route("/backends", backends, methods=["GET"]),
    Route("/admin/backends", set_backend, methods=["POST"]),
    Route("/metrics", metrics_endpoint, methods=["GET"]),  # Prometheus (polar.gateway.metrics)
]
