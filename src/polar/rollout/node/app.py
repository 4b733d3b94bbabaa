"""The node's HTTP faces: the gateway's model API for harnesses (data listener), and `/node/...` with the
gateway's control routes for the rollout server (control listener, token required).

    POST   /node/sessions        SessionSpec -> 202 {"session_id", "accepted": true, "duplicate": bool}
                                 (duplicate: this dispatch, same result token, was accepted before: a resend)
                                 409 seen before (single use), 429 full, 503 draining, 422 invalid (names the field)
    GET    /node/sessions        {"sessions": [NodeSessionState without results]}
    GET    /node/sessions/{id}   NodeSessionState (with the result once terminal), 404 not here; both name
                                 the node (x-polar-node). With the dispatch's x-polar-result-token, a 404
                                 is final: that dispatch is fenced
    DELETE /node/sessions/{id}   cancels (kills the process tree); answers the state once it ended
    GET    /node/status          NodeStatus
    POST   /node/drain           DrainRequest (optional) -> 202 NodeStatus: the node drains, then leaves
    POST   /node/judge_group     GroupRequest -> 200 {"scores", "rewards", "orderings", "details"}, or 200
                                 {"failed": reason} when the group has no judgement (fail-closed: every
                                 session of it is to be masked); 422 invalid (names the field). The judge
                                 calls are records in this node's gateway (`polar.evaluate.group_judging`)

Every control route needs the deployment's control token; a harness's session key opens none of them, and
the control listener is never reachable from a session's sandbox.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from polar.gateway.app import GatewayApp, HotPath, control_app, create_app
from polar.gateway.control import routes as control_routes
from polar.gateway.forward import Forwarder
from polar.harness.registry import classifier
from polar.jsontypes import JSON
from polar.limits import BodyError, format_path, json_error, nesting_message, nesting_path, read_body
from polar.rollout.node.admission import AdmissionError
from polar.rollout.protocol import NODE_ID_HEADER, RESULT_TOKEN_HEADER, DrainRequest, SessionSpec

if TYPE_CHECKING:
    from polar.rollout.node.node import Node

MAX_SPEC_BYTES = 8 << 20
MAX_DRAIN_BYTES = 64 << 10
MAX_GROUP_BYTES = 64 << 20  # up to 64 outcomes of a few parts each, clipped (`judge`'s max_chars)


def _json(body: JSON, status: int = 200) -> Response:
    if isinstance(body, BaseModel):
        return Response(body.model_dump_json().encode(), status_code=status, media_type="application/json")
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(status: int, message: str, field: str | None = None) -> Response:
    err: dict[str, Any] = {"message": message}
    if field is not None:
        err["field"] = field
    return _json({"error": err}, status)


def _validation_error(exc: ValidationError) -> Response:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "body"
    return _error(422, f"{field}: {first['msg']}", field)


class NodeApp:
    """The node's two listeners: `data`, the gateway's model API (what runtimes are pointed at), and
    `control`, the `/node/...` routes plus the gateway's control routes behind the control token."""

    def __init__(self, node: Node) -> None:
        self.node = node
        node_routes = [
            Route("/node/sessions", self.submit, methods=["POST"]),
            Route("/node/sessions", self.list_sessions, methods=["GET"]),
            Route("/node/sessions/{session_id}", self.get_session, methods=["GET"]),
            Route("/node/sessions/{session_id}", self.cancel_session, methods=["DELETE"]),
            Route("/node/status", self.status, methods=["GET"]),
            Route("/node/drain", self.drain, methods=["POST"]),
            Route("/node/judge_group", self.judge_group, methods=["POST"]),
        ]
        token = node.config.gateway.control_token
        self.gateway: GatewayApp | None = None
        if node.config.gateway_workers > 1:
            # The gateway runs in its own processes (`gateway_link.GatewayChild`): its control routes are
            # passed to them as they came (the same token opens both), `/metrics` is the node's and theirs.
            self.registry = CollectorRegistry()
            self._forward = Forwarder()
            routes = [
                *node_routes,
                Route("/metrics", self.metrics, methods=["GET"]),
                Mount("", app=self.to_workers),
            ]
            self.control = control_app(State(), token, routes)
        else:
            self.gateway = create_app(node.config.gateway, classifier)
            self.registry = self.gateway.state.metrics_registry
            self.control = control_app(self.gateway.state, token, [*node_routes, *control_routes])

    @property
    def data(self) -> HotPath:
        assert self.gateway is not None, "the gateway's model API is served by its workers"
        return self.gateway.data

    async def to_workers(self, scope: Any, receive: Any, send: Any) -> None:
        """A gateway control request, to the workers' control listener (which sends it where its session is)."""
        child = self.node.servers.child
        assert child is not None
        await self._forward(child.control_url, scope, receive, send)

    async def metrics(self, request: Request) -> Response:
        """The node's metrics and the gateway workers' (summed over them by their control router), in
        Prometheus' text format."""
        own = generate_latest(self.registry)
        theirs = await self.node.servers.metrics()
        return Response(own + theirs, media_type=CONTENT_TYPE_LATEST)

    async def aclose(self) -> None:
        if self.gateway is None:
            await self._forward.aclose()

    async def submit(self, request: Request) -> Response:
        try:
            body = await read_body(request, MAX_SPEC_BYTES, self.node.config.gateway.body_timeout_s)
        except BodyError as exc:
            response = _error(exc.status, f"session spec: {exc.message}")
            if exc.status == 408:  # the rest may still come: it must not be read as the next request
                response.headers["connection"] = "close"
            return response
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            if "depth limit" in str(exc):
                return _error(422, json_error(exc), "body")
            data = None  # pydantic names what is wrong with it below
        # The task's metadata and the agent's settings are free-form: refuse what could not be stored.
        path = nesting_path(data)
        if path is not None:
            return _error(422, nesting_message(path), format_path(path))
        try:
            spec = SessionSpec.model_validate_json(body)
        except ValidationError as exc:
            return _validation_error(exc)
        try:
            new = await self.node.submit(spec)
        except AdmissionError as exc:
            return _error(exc.status, exc.message, exc.field)
        return _json({"session_id": spec.session_id, "accepted": True, "duplicate": not new}, 202)

    async def list_sessions(self, request: Request) -> Response:
        states = [s.model_dump(mode="json", exclude={"result"}) for s in self.node.sessions()]
        return _json({"sessions": states})

    async def get_session(self, request: Request) -> Response:
        sid = request.path_params["session_id"]
        dispatch = request.headers.get(RESULT_TOKEN_HEADER)
        state = self.node.probe(sid, dispatch) if dispatch else self.node.state(sid)
        response = _error(404, f"no session {sid} on this node") if state is None else _json(state)
        response.headers[NODE_ID_HEADER] = self.node.node_id
        return response

    async def cancel_session(self, request: Request) -> Response:
        sid = request.path_params["session_id"]
        reason = request.query_params.get("reason") or "cancelled by request"
        state = await self.node.cancel(sid, reason)
        if state is None:
            return _error(404, f"no session {sid} on this node")
        return _json(state)

    async def status(self, request: Request) -> Response:
        return _json(self.node.status())

    async def drain(self, request: Request) -> Response:
        try:
            body = await read_body(request, MAX_DRAIN_BYTES, self.node.config.gateway.body_timeout_s)
        except BodyError as exc:
            return _error(exc.status, f"drain request: {exc.message}")
        try:
            req = DrainRequest.model_validate_json(body) if body.strip() else DrainRequest()
        except ValidationError as exc:
            return _validation_error(exc)
        self.node.start_drain(req.reason, req.timeout_s)
        return _json(self.node.status(), 202)

    async def judge_group(self, request: Request) -> Response:
        """A group's outcomes judged together through this node's gateway (the server's group phase)."""
        from polar.evaluate.group_judging import GroupJudgeConfig, GroupRequest, judge_group
        from polar.evaluate.support import EvaluatorError, parse_config

        try:
            body = await read_body(request, MAX_GROUP_BYTES, self.node.config.gateway.body_timeout_s)
        except BodyError as exc:
            return _error(exc.status, f"group request: {exc.message}")
        try:
            req = GroupRequest.model_validate_json(body)
        except ValidationError as exc:
            return _validation_error(exc)
        try:
            config = parse_config("judge_group", GroupJudgeConfig, req.config)
        except ValueError as exc:
            return _error(422, str(exc), "config")
        models = self.node.models()
        meta = {"judged_task_id": req.task_id}
        try:
            verdict = await judge_group(config, models, req.instruction, req.outcomes, meta)
        except EvaluatorError as exc:
            return _json({"failed": str(exc)})
        return _json(
            {
                "scores": verdict.scores,
                "rewards": verdict.rewards(config.scale),
                "orderings": verdict.orderings,
                "details": verdict.details,
            }
        )


def create_node_app(node: Node) -> NodeApp:
    return NodeApp(node)
