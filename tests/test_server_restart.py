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
from tests.server_support import AUTH, StandInNode, result, start_server, task, wait_until


def test_restart_keeps_results_and_resumes_tasks(tmp_path: Path) -> None:
    db = tmp_path / "server.db"
    trainer_port = free_port()  # nothing listens here until after the restart
    callback = f"http://127.0.0.1:{trainer_port}/cb"
    patient = RetryPolicy(attempts=1000, backoff_s=0.02, backoff_max_s=0.05, timeout_s=2.0)
    http = httpx.Client(timeout=30, headers=AUTH)
    first = start_server(db, callbacks=patient)
    node = StandInNode().register(http, first.url)
    try:
        r = http.post(
            f"{first.url}/rollout/task/submit",
            json=[task("t1", num_samples=2, callback_url=callback), task("t2")],
        )
        assert r.status_code == 201
        a, b = r.json()["tasks"][0]["session_ids"]
        node.report(http, first.url, result(a, "t1", reward=1.0, trajectory={"traces": [1, 2]}))
        node.result_token(b)  # b is on the node too, still running when the server goes down
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
        assert {s["session_id"]: s["status"] for s in view["sessions"]} == {a: "COMPLETED", b: "DISPATCHED"}
        assert http.get(f"{second.url}/rollout/task/t2").json()["state"] == "ACTIVE"
        # the unfinished task carries on: its last session ends, the task finishes, the trainer hears of it
        # the node reports b to the restarted server with the credential of b's dispatch, kept in its state
        node.report(http, second.url, result(b, "t1", "ERROR", reason="boom"))
        assert http.get(f"{second.url}/rollout/task/t1").json()["state"] == "DONE"
        wait_until(lambda: len(received) == 3, what="the queued and new callbacks")
        assert sorted(x["event"] for x in received) == ["session_result", "session_result", "task_done"]
        # a session id is single-use across restarts too: a second report of `a` changes nothing
        assert node.report(http, second.url, result(a, "t1", "ERROR")).json()["outcome"] == "duplicate"
    finally:
        second.stop()
        trainer.stop()
        node.stop()
        http.close()


async def test_after_a_restart_queued_sessions_run_and_kept_results_are_collected(tmp_path: Path) -> None:
    """Across a restart with a real node: a session that finished on the node while the server was down
    (the node gave up delivering it) is collected by the startup probe; a session still queued is
    dispatched once a node is there."""
    import asyncio

    from tests.node_support import eventually, fake_policy, running_node, until

    db = tmp_path / "server.db"
    port = free_port()
    gate = tmp_path / "go"
    wait_gate = {"harness": "shell", "settings": {"command": f"while [ ! -f {gate} ]; do sleep 0.05; done"}}
    server = start_server(db, port=port)
    restarted = None
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(
                    url, tmp_path, server_url=server.url, heartbeat_s=0.05, report_attempts=1, capacity=1
                ) as node,
                httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
            ):

                async def healthy() -> bool:
                    nodes = (await client.get("/nodes")).json()["nodes"]
                    return bool(nodes) and bool(nodes[0]["healthy"])

                await eventually(healthy, "a healthy node")
                body = [
                    task("first", agent=wait_gate, runtime={"backend": "local"}),  # reads a host gate
                    task("second", agent={"harness": "shell", "settings": {"command": "true"}}),
                ]
                assert (await client.post("/rollout/task/submit", json=body)).status_code == 201
                await until(lambda: node.status().by_stage.get("RUNNING") == 1, "the first session to run")
                await asyncio.to_thread(server.stop)
                gate.touch()
                await until(lambda: len(node.reporter.delivered) == 1, "the node to give up delivering")
                assert list(node.reporter.delivered.values()) == [False]
                # no periodic audit: only the startup probe can find the kept result
                restarted = await asyncio.to_thread(start_server, db, port, audit_interval_s=3600)

                async def done() -> dict[str, str] | None:
                    states = {
                        t: (await client.get(f"/rollout/task/{t}")).json()["state"]
                        for t in ("first", "second")
                    }
                    return states if set(states.values()) == {"DONE"} else None

                await eventually(done, "both tasks after the restart")
                views = [(await client.get(f"/rollout/task/{t}")).json() for t in ("first", "second")]
    finally:
        (restarted or server).stop()
    for view in views:
        (res,) = view["results"]
        assert res["status"] == "COMPLETED" and res["node_id"] == "node-test", res
