"""The rollout server's routes through real HTTP: submission checks, task status, results, cancel, node
registration and session callbacks. Nodes are not running here; a test posts what a node would post."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.serving import ServerThread
from tests.server_support import AUTH, StandInNode, post_result, result, start_server, task, wait_until


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    srv = start_server(tmp_path / "server.db")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30, headers=AUTH) as c:
        yield c


@pytest.fixture
def node(server: ServerThread, http: httpx.Client) -> Iterator[StandInNode]:
    """A registered node taking every dispatch; tests report results through it (with their credential)."""
    n = StandInNode("n1").register(http, server.url)
    try:
        yield n
    finally:
        n.stop()


def submit(http: httpx.Client, url: str, body: Any) -> httpx.Response:
    return http.post(f"{url}/rollout/task/submit", json=body)


def error_of(r: httpx.Response) -> dict[str, Any]:
    err: dict[str, Any] = r.json()["error"]
    return err


def test_submit_expands_samples_into_single_use_session_ids(server: ServerThread, http: httpx.Client) -> None:
    r = submit(http, server.url, task("t1", num_samples=3))
    assert r.status_code == 201, r.text
    (created,) = r.json()["tasks"]
    sids = created["session_ids"]
    assert created["task_id"] == "t1" and len(sids) == 3 and len(set(sids)) == 3
    assert all(s.startswith("polar-") and len(s) >= 16 for s in sids)
    view = http.get(f"{server.url}/rollout/task/t1").json()
    assert view["state"] == "ACTIVE"
    assert view["counts"] == {"REGISTERED": 3}
    assert [s["sample_index"] for s in view["sessions"]] == [0, 1, 2]
    assert view["results"] == []


def test_submit_accepts_a_list_and_the_tasks_wrapper(server: ServerThread, http: httpx.Client) -> None:
    assert submit(http, server.url, [task("a"), task("b")]).status_code == 201
    r = submit(http, server.url, {"tasks": [task("c")]})
    assert r.status_code == 201
    assert http.get(f"{server.url}/rollout/status").json()["tasks"] == {"ACTIVE": 3}


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (task("t", runtime={"backend": "kubernetes"}), "runtime.backend", "local"),
        ({"tasks": [task("ok"), task("bad", num_samples=0)]}, "tasks[1].num_samples", "greater than"),
        (
            task("t", evaluator={"strategy": "nope.mod:Thing"}),
            "evaluator.strategy",
            "not accepted from the network",
        ),
        (task("t", evaluator={"strategy": "tests.nope:Thing"}), "evaluator.strategy", "cannot import"),
        (task("t", evaluator={"strategy": "no-such-eval"}), "evaluator.strategy", "unknown evaluator"),
        (task("t", evaluator={"strategy": "command"}), "evaluator.config", "evaluator.config"),
        (task("t", agent={"harness": "nope.mod:Agent"}), "agent.harness", "not accepted from the network"),
        (task("t", agent={"harness": "tests.nope:Agent"}), "agent.harness", "cannot import"),
        (task("t", agent={"harness": "no-such-agent"}), "agent.harness", "unknown harness"),
        (task("t", agent={"harness": "shell"}), "agent.settings", "agent.settings"),
        (task("t", builder="no_such_builder"), "builder", "no_such_builder"),
        (task("t", runtime={"backend": "docker"}), "runtime.image", "needs an image"),
        # Was: the engines read an image starting with "-" as one of their options (docker run --privileged).
        (task("t", runtime={"backend": "docker", "image": "--privileged"}), "runtime.image", "not starting"),
        (task("t", runtime={"backend": "podman", "image": "x:1 --rm"}), "runtime.image", "no whitespace"),
        (task("t", callback_url="ftp://x"), "callback_url", "http(s)"),
        (task("t", num_samples=2, early_stop_min_usable=3), "early_stop_min_usable", "exceeds"),
        (task("t", colour="red"), "colour", "Extra inputs"),
        ({"instruction": "x"}, "task_id", "Field required"),
        ({"tasks": []}, "tasks", "non-empty"),
        ([task("d"), task("d")], "task_id", "duplicate"),
    ],
)
def test_bad_submissions_are_400_naming_the_field(
    server: ServerThread, http: httpx.Client, body: Any, param: str, needle: str
) -> None:
    r = submit(http, server.url, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param
    assert needle in err["message"]
    # nothing of a refused submission is stored, not even its valid tasks
    assert http.get(f"{server.url}/rollout/status").json()["tasks"] == {}


def test_malformed_bodies_and_unknown_routes(server: ServerThread, http: httpx.Client) -> None:
    r = http.post(f"{server.url}/rollout/task/submit", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in error_of(r)["message"]
    r = http.post(f"{server.url}/rollout/task/submit", content=b"")
    assert r.status_code == 400 and "empty body" in error_of(r)["message"]
    r = http.post(f"{server.url}/rollout/task/submit", json=42)
    assert r.status_code == 400
    r = http.get(f"{server.url}/rollout/nothing")
    assert r.status_code == 404 and error_of(r)["type"] == "not_found"
    r = http.put(f"{server.url}/rollout/task/submit")
    assert r.status_code == 405
    r = http.get(f"{server.url}/rollout/task/missing")
    assert r.status_code == 404 and error_of(r)["param"] == "task_id"
    r = http.delete(f"{server.url}/rollout/task/missing")
    assert r.status_code == 404


def test_oversized_body_is_413(tmp_path: Path, http: httpx.Client) -> None:
    srv = start_server(tmp_path / "s.db", max_body_bytes=1000)
    try:
        r = submit(http, srv.url, task("t", instruction="x" * 5000))
        assert r.status_code == 413
    finally:
        srv.stop()


def test_resubmitting_a_task_id_is_409(server: ServerThread, http: httpx.Client) -> None:
    assert submit(http, server.url, task("t1")).status_code == 201
    r = submit(http, server.url, [task("t2"), task("t1")])
    assert r.status_code == 409 and error_of(r)["param"] == "task_id"
    assert http.get(f"{server.url}/rollout/task/t2").status_code == 404  # all or nothing


def _sessions(http: httpx.Client, url: str, task_id: str) -> list[str]:
    return [s["session_id"] for s in http.get(f"{url}/rollout/task/{task_id}").json()["sessions"]]


def test_results_are_recorded_once_and_the_task_finishes(
    server: ServerThread, http: httpx.Client, node: StandInNode
) -> None:
    submit(http, server.url, task("t1", num_samples=2, metadata={"policy_version": 3}))
    a, b = _sessions(http, server.url, "t1")
    r = node.report(http, server.url, result(a, "t1", reward=1.0, node_id="n1"))
    assert r.json() == {"ack": True, "outcome": "recorded"}
    # a second report of the same session (a node retrying after a lost ack) does not replace the first
    r = node.report(http, server.url, result(a, "t1", "ERROR", reason="late"))
    assert r.status_code == 200 and r.json()["outcome"] == "duplicate"
    # progress reports move the stage without finishing anything
    r = node.report(http, server.url, result(b, "t1", "RUNNING"))
    assert r.json()["outcome"] == "progress"
    view = http.get(f"{server.url}/rollout/task/t1").json()
    assert view["counts"] == {"COMPLETED": 1, "RUNNING": 1} and view["state"] == "ACTIVE"
    node.report(http, server.url, result(b, "t1", "TIMEOUT", reason="deadline", reward=0.0))
    view = http.get(f"{server.url}/rollout/task/t1").json()
    assert view["state"] == "DONE"
    assert [(x["session_id"], x["status"], x["reward"]) for x in view["results"]] == [
        (a, "COMPLETED", 1.0),
        (b, "TIMEOUT", 0.0),
    ]
    assert view["results"][0]["node_id"] == "n1"


def test_session_result_errors(server: ServerThread, http: httpx.Client, node: StandInNode) -> None:
    submit(http, server.url, [task("t1"), task("t2")])
    (a,) = _sessions(http, server.url, "t1")
    r = post_result(http, server.url, result("polar-unknown", "t1"), "made-up")
    assert r.status_code == 404 and error_of(r)["param"] == "session_id"
    r = node.report(http, server.url, result(a, "t2"))
    assert r.status_code == 409 and error_of(r)["param"] == "task_id"
    r = node.report(http, server.url, result(a, "t1", "FINISHED"))
    assert r.status_code == 400 and error_of(r)["param"] == "status"
    r = post_result(http, server.url, {"session_id": a})
    assert r.status_code == 400 and error_of(r)["param"] in ("task_id", "status")


def test_early_stop_cancels_the_rest_once_enough_are_usable(
    server: ServerThread, http: httpx.Client, node: StandInNode
) -> None:
    submit(http, server.url, task("t1", num_samples=4, early_stop_min_usable=2))
    s = _sessions(http, server.url, "t1")
    node.report(http, server.url, result(s[0], "t1", "ERROR", reason="crash"))  # not usable
    node.report(http, server.url, result(s[1], "t1"))
    assert http.get(f"{server.url}/rollout/task/t1").json()["state"] == "ACTIVE"
    node.report(http, server.url, result(s[2], "t1"))
    view = http.get(f"{server.url}/rollout/task/t1").json()
    assert view["state"] == "DONE" and view["reason"].startswith("early stop")
    assert view["counts"] == {"ERROR": 1, "COMPLETED": 2, "CANCELLED": 1}
    (cancelled,) = [x for x in view["results"] if x["status"] == "CANCELLED"]
    assert cancelled["session_id"] == s[3] and "early stop" in cancelled["reason"]
    assert cancelled["metadata"]["sample_index"] == 3 and cancelled["metadata"]["group_id"] == "t1"


def test_cancel_ends_queued_sessions_and_is_idempotent(server: ServerThread, http: httpx.Client) -> None:
    submit(http, server.url, task("t1", num_samples=2))
    r = http.delete(f"{server.url}/rollout/task/t1")
    assert r.json() == {"task_id": "t1", "cancelled": True, "state": "CANCELLED"}
    view = http.get(f"{server.url}/rollout/task/t1").json()
    assert view["counts"] == {"CANCELLED": 2}
    assert all(x["reason"] == "cancelled by request" for x in view["results"])
    assert http.delete(f"{server.url}/rollout/task/t1").json()["cancelled"] is False


def test_results_long_poll_answers_when_a_result_lands(
    server: ServerThread, http: httpx.Client, node: StandInNode
) -> None:
    submit(http, server.url, [task("t1", num_samples=2), task("t2")])
    a, b = _sessions(http, server.url, "t1")
    page = http.get(f"{server.url}/rollout/results", params={"task": "t1", "after": 0, "wait": 0}).json()
    assert page == {"results": [], "next": 0, "tasks": {"t1": "ACTIVE"}}
    node.report(http, server.url, result(b, "t1"))
    page = http.get(f"{server.url}/rollout/results", params={"task": "t1", "after": 0, "wait": 5}).json()
    assert [x["session_id"] for x in page["results"]] == [b]
    cursor = page["next"]
    node.report(http, server.url, result(a, "t1", "ERROR"))
    page = http.get(f"{server.url}/rollout/results", params={"task": "t1", "after": cursor, "wait": 5}).json()
    assert [x["session_id"] for x in page["results"]] == [a] and page["tasks"] == {"t1": "DONE"}
    r = http.get(f"{server.url}/rollout/results", params={"task": "nope"})
    assert r.status_code == 404
    r = http.get(f"{server.url}/rollout/results", params={"task": "t1", "wait": "soon"})
    assert r.status_code == 400 and error_of(r)["param"] == "wait"
    assert http.get(f"{server.url}/rollout/results").status_code == 400


def test_node_registration_and_heartbeats(server: ServerThread, http: httpx.Client) -> None:
    r = http.post(
        f"{server.url}/nodes/register", json={"node_id": "n1", "url": "http://127.0.0.1:9", "capacity": 2}
    )
    assert r.json() == {"node_id": "n1"}
    beat = {"node_id": "n1", "active": 1, "capacity": 3, "by_stage": {"RUNNING": 1}}
    assert http.post(f"{server.url}/nodes/n1/heartbeat", json=beat).status_code == 200
    (node,) = http.get(f"{server.url}/nodes").json()["nodes"]
    assert node["healthy"] and node["capacity"] == 3 and node["status"]["by_stage"] == {"RUNNING": 1}
    r = http.post(f"{server.url}/nodes/n2/heartbeat", json={**beat, "node_id": "n2"})
    assert r.status_code == 404 and "register first" in error_of(r)["message"]
    r = http.post(f"{server.url}/nodes/n1/heartbeat", json={**beat, "node_id": "other"})
    assert r.status_code == 400 and error_of(r)["param"] == "node_id"
    r = http.post(f"{server.url}/nodes/register", json={"node_id": "n3", "url": "x", "capacity": 1})
    assert r.status_code == 400 and error_of(r)["param"] == "url"
    r = http.post(f"{server.url}/nodes/register", json={"node_id": "n3", "url": "http://h", "capacity": 0})
    assert r.status_code == 400 and error_of(r)["param"] == "capacity"
    status = http.get(f"{server.url}/rollout/status").json()
    assert status["nodes"]["total"] == 1 and status["nodes"]["healthy"] == 1


def test_a_dead_node_gets_nothing_and_sessions_wait(server: ServerThread, http: httpx.Client) -> None:
    """A registered node whose port refuses connections: dispatches are refused (never sent), the sessions
    stay queued, and after too many refusals end as ERROR with the reason instead of looping forever."""
    from polar.serving import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    http.post(f"{server.url}/nodes/register", json={"node_id": "n1", "url": dead, "capacity": 4})
    submit(http, server.url, task("t1"))

    def ended() -> Any:
        view = http.get(f"{server.url}/rollout/task/t1").json()
        return view if view["state"] == "DONE" else None

    view = wait_until(ended, what="the session to run out of dispatch attempts")
    (res,) = view["results"]
    assert res["status"] == "ERROR" and "not accepted by any node after 5 dispatch attempts" in res["reason"]


def test_results_come_in_pages_behind_a_cursor(
    server: ServerThread, http: httpx.Client, node: StandInNode
) -> None:
    submit(http, server.url, task("t1", num_samples=5))
    for sid in _sessions(http, server.url, "t1"):
        node.report(http, server.url, result(sid, "t1"))
    seen: list[str] = []
    cursor = 0
    while True:
        params = {"task": "t1", "after": cursor, "limit": 2}
        page = http.get(f"{server.url}/rollout/results", params=params).json()
        if not page["results"]:
            break
        assert len(page["results"]) <= 2
        seen += [x["session_id"] for x in page["results"]]
        cursor = page["next"]
    assert seen == _sessions(http, server.url, "t1")
    r = http.get(f"{server.url}/rollout/results", params={"task": "t1", "limit": 0})
    assert r.status_code == 400 and error_of(r)["param"] == "limit"
