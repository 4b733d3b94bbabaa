"""Helpers for the rollout server tests: a real server on loopback with fast clocks, task builders, and a
stand-in node that takes dispatches and reports results with their dispatch credential (what a real node
does), for tests about the server alone."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from polar.auth import bearer, new_token
from polar.dashboard import server_app
from polar.netguard import OutboundPolicy
from polar.rollout.protocol import RESULT_TOKEN_HEADER, SessionSpec
from polar.rollout.server import ServerConfig
from polar.rollout.server.callbacks import RetryPolicy
from polar.serving import ServerThread

TOKEN = new_token()  # the control token of every server these helpers start
AUTH = bearer(TOKEN)

FAST = {
    "tick_s": 0.05,
    "probe_interval_s": 0.05,
    "refuse_cooldown_s": 0.05,
    "node_timeout_s": 2.0,
    "callbacks": RetryPolicy(attempts=4, backoff_s=0.02, backoff_max_s=0.1, timeout_s=2.0),
    # Test receivers (callback endpoints, frozen models) listen on loopback, which an operator must allow.
    "outbound": OutboundPolicy(allow=("127.0.0.1",)),
}


def start_server(db_path: Path, port: int | None = None, **overrides: Any) -> ServerThread:
    config = ServerConfig(db_path=db_path, **{"token": TOKEN, **FAST, **overrides})
    return ServerThread(server_app(config), port=port).start()


def task(task_id: str = "t1", **fields: Any) -> dict[str, Any]:
    return {"task_id": task_id, "instruction": "fix the failing test", **fields}


def wait_until(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll until `check()` is truthy (no timing assertion: the timeout only bounds a hung test)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def result(session_id: str, task_id: str, status: str = "COMPLETED", **fields: Any) -> dict[str, Any]:
    return {"session_id": session_id, "task_id": task_id, "status": status, **fields}


def post_result(
    client: httpx.Client, url: str, body: dict[str, Any], result_token: str | None = None
) -> httpx.Response:
    headers = {RESULT_TOKEN_HEADER: result_token} if result_token is not None else {}
    return client.post(f"{url}/callbacks/session_result", json=body, headers={**AUTH, **headers})


class StandInNode:
    """A node that accepts every dispatch and runs nothing: a test reports each session's result itself,
    through `report`, with the credential the server sent in that session's dispatch."""

    def __init__(self, node_id: str = "n1") -> None:
        self.node_id = node_id
        self.specs: dict[str, SessionSpec] = {}
        self.cancelled: list[str] = []
        app = Starlette(
            routes=[
                Route("/node/sessions", self._dispatch, methods=["POST"]),
                Route("/node/sessions/{sid}", self._probe, methods=["GET"]),
                Route("/node/sessions/{sid}", self._cancel, methods=["DELETE"]),
            ]
        )
        self.server = ServerThread(app).start()

    async def _dispatch(self, request: Request) -> JSONResponse:
        assert request.headers.get("authorization") == AUTH["authorization"]  # the server sends its token
        spec = SessionSpec.model_validate_json(await request.body())
        self.specs[spec.session_id] = spec
        return JSONResponse({"session_id": spec.session_id, "accepted": True}, status_code=202)

    async def _probe(self, request: Request) -> JSONResponse:
        sid = request.path_params["sid"]
        if sid not in self.specs:
            return JSONResponse({"error": {"message": "never seen"}}, status_code=404)
        return JSONResponse({"session_id": sid, "status": "DISPATCHED"})

    async def _cancel(self, request: Request) -> JSONResponse:
        self.cancelled.append(request.path_params["sid"])
        return JSONResponse({"session_id": request.path_params["sid"], "status": "CANCELLED"})

    def register(self, client: httpx.Client, server_url: str, capacity: int = 64) -> StandInNode:
        body = {"node_id": self.node_id, "url": self.server.url, "capacity": capacity}
        r = client.post(f"{server_url}/nodes/register", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        return self

    def result_token(self, session_id: str) -> str:
        spec = wait_until(lambda: self.specs.get(session_id), what=f"the dispatch of {session_id}")
        assert spec.result_token
        return spec.result_token

    def report(self, client: httpx.Client, server_url: str, body: dict[str, Any]) -> httpx.Response:
        """POST a result as this node would: after the session's dispatch, with its credential."""
        token = self.result_token(body["session_id"])
        return post_result(client, server_url, {"node_id": self.node_id, **body}, token)

    def stop(self) -> None:
        self.server.stop()


def interruptible() -> None:
    """`preexec_fn` for a child a test will Ctrl-C: SIGINT as a terminal delivers it. A suite started in the
    background by a script (`scripts/test &`) runs with SIGINT ignored, as POSIX shells start background jobs;
    its children inherit that, and Python then never raises KeyboardInterrupt (`polar run`, `polar train`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
