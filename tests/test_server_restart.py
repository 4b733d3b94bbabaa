"""Restart durability through real HTTP: stop the server, start another on the same file; finished
results are still there, unfinished tasks carry on, undelivered trainer callbacks are delivered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from polar.rollout.server.callbacks import RetryPolicy
from polar.serving import ServerThread, free_port
from tests.server_support import post_result, result, start_server, task, wait_until


def test_restart_keeps_results_and_resumes_tasks(tmp_path: Path) -> None:
    db = tmp_path / "server.db"
    trainer_port = free_port()  # nothing listens here until after the restart
    callback = f"http://127.0.0.1:{trainer_port}/cb"
    patient = RetryPolicy(attempts=1000, backoff_s=0.02, backoff_max_s=0.05, timeout_s=2.0)
    http = httpx.Client(timeout=30)
    first = start_server(db, callbacks=patient)
    try:
        r = http.post(
            f"{first.url}/rollout/task/submit",
            json=[task("t1", num_samples=2, callback_url=callback), task("t2")],
        )
        assert r.status_code == 201
        a, b = r.json()["tasks"][0]["session_ids"]
        post_result(http, first.url, result(a, "t1", reward=1.0, trajectory={"traces": [1, 2]}))
    finally:
        first.stop()

    received: list[Any] = []

    async def cb(request: Request) -> Response:
        received.append(await request.json())
        return Response(b"{}")

    trainer = ServerThread(Starlette(routes=[Route("/cb", cb, methods=["POST"])]), port=trainer_port).start()
    second = start_server(db, callbacks=patient)
    try:
        view = http.get(f"{second.url}/rollout/task/t1").json()
        assert view["state"] == "ACTIVE"
        assert [(x["session_id"], x["reward"], x["trajectory"]) for x in view["results"]] == [
            (a, 1.0, {"traces": [1, 2]})
        ]
        assert {s["session_id"]: s["status"] for s in view["sessions"]} == {a: "COMPLETED", b: "REGISTERED"}
        assert http.get(f"{second.url}/rollout/task/t2").json()["state"] == "ACTIVE"
        # the unfinished task carries on: its last session ends, the task finishes, the trainer hears of it
        post_result(http, second.url, result(b, "t1", "ERROR", reason="boom"))
        assert http.get(f"{second.url}/rollout/task/t1").json()["state"] == "DONE"
        wait_until(lambda: len(received) == 3, what="the queued and new callbacks")
        assert sorted(x["event"] for x in received) == ["session_result", "session_result", "task_done"]
        # a session id is single-use across restarts too: a second report of `a` changes nothing
        assert post_result(http, second.url, result(a, "t1", "ERROR")).json()["outcome"] == "duplicate"
    finally:
        second.stop()
        trainer.stop()
        http.close()
