"""Trainer callbacks against real local HTTP servers: one that fails N times before acknowledging, one
that is down. Retries, backoff and the recorded outcome; a down URL never holds anything else up."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar.serving import ServerThread, free_port, serve
from tests.server_support import AUTH, StandInNode, result, start_server, task, wait_until


class Trainer:
    """A trainer's callback endpoint that answers 500 to the first `fail` requests of each event kind."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.seen: list[dict[str, Any]] = []
        self.ok: list[dict[str, Any]] = []

    async def handle(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.seen.append(body)
        if sum(b["event"] == body["event"] for b in self.seen) <= self.fail:
            return Response("overloaded", status_code=500)
        self.ok.append(body)
        return Response(b"{}", media_type="application/json")


@pytest.fixture
def trainer() -> Iterator[tuple[Trainer, str]]:
    t = Trainer(fail=2)
    with serve(Starlette(routes=[Route("/cb", t.handle, methods=["POST"])])) as srv:
        yield t, f"{srv.url}/cb"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    srv = start_server(tmp_path / "server.db")
    try:
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def _node(http: httpx.Client, server: ServerThread) -> Iterator[StandInNode]:
    node = StandInNode().register(http, server.url)
    try:
        yield node
    finally:
        node.stop()


def _sessions(http: httpx.Client, url: str, task_id: str) -> list[str]:
    return [s["session_id"] for s in http.get(f"{url}/rollout/task/{task_id}").json()["sessions"]]


def test_callbacks_are_retried_until_acknowledged(server: ServerThread, trainer: tuple[Trainer, str]) -> None:
    endpoint, url = trainer
    with httpx.Client(timeout=30, headers=AUTH) as http, _node(http, server) as node:
        http.post(f"{server.url}/rollout/task/submit", json=task("t1", callback_url=url))
        (sid,) = _sessions(http, server.url, "t1")
        node.report(http, server.url, result(sid, "t1", reward=1.0, trajectory={"status": "COMPLETED"}))

        def delivered() -> Any:
            cbs = http.get(f"{server.url}/rollout/task/t1").json()["callbacks"]
            return cbs if all(c["state"] == "delivered" for c in cbs) and len(cbs) == 2 else None

        cbs = wait_until(delivered, what="both callbacks to be delivered")
    session_cb, done_cb = cbs
    assert session_cb["session_id"] == sid and session_cb["attempts"] == 3  # two 500s, then 2xx
    assert done_cb["session_id"] is None and done_cb["attempts"] == 3
    by_event = {b["event"]: b for b in endpoint.ok}
    assert by_event["session_result"]["result"]["session_id"] == sid
    assert by_event["session_result"]["result"]["reward"] == 1.0
    assert by_event["session_result"]["result"]["trajectory"] == {"status": "COMPLETED"}
    assert by_event["task_done"]["task_id"] == "t1" and by_event["task_done"]["state"] == "DONE"
    assert by_event["task_done"]["counts"] == {"COMPLETED": 1}


def test_a_down_callback_url_is_recorded_and_blocks_nothing(
    server: ServerThread, trainer: tuple[Trainer, str]
) -> None:
    endpoint, good = trainer
    endpoint.fail = 0
    down = f"http://127.0.0.1:{free_port()}/cb"
    with httpx.Client(timeout=30, headers=AUTH) as http, _node(http, server) as node:
        http.post(
            f"{server.url}/rollout/task/submit",
            json=[task("down", callback_url=down), task("up", callback_url=good)],
        )
        (d,) = _sessions(http, server.url, "down")
        (u,) = _sessions(http, server.url, "up")
        assert node.report(http, server.url, result(d, "down")).status_code == 200
        assert node.report(http, server.url, result(u, "up")).status_code == 200

        def settled() -> Any:
            down_cbs = http.get(f"{server.url}/rollout/task/down").json()["callbacks"]
            up_cbs = http.get(f"{server.url}/rollout/task/up").json()["callbacks"]
            done = all(c["state"] == "failed" for c in down_cbs) and all(
                c["state"] == "delivered" for c in up_cbs
            )
            return (down_cbs, up_cbs) if done and len(down_cbs) == 2 and len(up_cbs) == 2 else None

        down_cbs, _ = wait_until(settled, what="callbacks to fail and deliver")
        view = http.get(f"{server.url}/rollout/task/down").json()
    assert all(c["attempts"] == 4 and "Connect" in c["last_error"] for c in down_cbs)
    assert view["state"] == "DONE" and view["results"][0]["status"] == "COMPLETED"  # the result is kept
    assert sorted(b["event"] for b in endpoint.ok) == ["session_result", "task_done"]
