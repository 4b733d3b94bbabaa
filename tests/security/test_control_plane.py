"""The control plane is authenticated end to end, results come only from the node a session was dispatched
to, and no code is imported because a network request named it (issue #10, points 1-3).

Each test reproduces a finding measured on main before the fix:
  - the rollout server had no authentication: a made-up COMPLETED result with reward 1.0 for a session that
    never ran was recorded and the task finished DONE with it;
  - a node started with a control token never got work, silently (the server sent no token);
  - `builder: "os:system"` and `"subprocess:Popen"` passed submit.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from polar.auth import TokenError, load_token, new_token
from polar.cli import main
from polar.client import RolloutClient
from polar.rollout.protocol import RESULT_TOKEN_HEADER
from tests.node_support import eventually, fake_policy, running_node, shell_task, spec
from tests.server_support import AUTH, TOKEN, StandInNode, start_server, task, wait_until

CONTROL_ROUTES = [
    ("POST", "/rollout/task/submit"),
    ("GET", "/rollout/task/t1"),
    ("DELETE", "/rollout/task/t1"),
    ("GET", "/rollout/results?task=t1"),
    ("GET", "/rollout/status"),
    ("GET", "/events"),
    ("POST", "/callbacks/session_result"),
    ("POST", "/nodes/register"),
    ("POST", "/nodes/n1/heartbeat"),
    ("POST", "/nodes/n1/drain"),
    ("POST", "/nodes/n1/leave"),
    ("GET", "/nodes"),
    ("GET", "/metrics"),
]


def test_every_server_route_but_health_needs_the_token(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for method, path in CONTROL_ROUTES:
                for headers in ({}, {"authorization": f"Bearer {new_token()}"}, {"authorization": TOKEN}):
                    r = http.request(method, path, headers=headers, json={})
                    assert r.status_code == 401, (method, path, headers, r.text)
                    assert r.json()["error"]["type"] == "authentication_error"
            assert http.get("/health").status_code == 200
            status = http.get("/rollout/status", headers=AUTH).json()
    finally:
        server.stop()
    assert status["security"]["auth_refused"] == 3 * len(CONTROL_ROUTES)
    assert status["security"]["recent"][-1]["client"].startswith("127.0.0.1:")


def test_a_forged_result_is_refused_and_counted(tmp_path: Path) -> None:
    """A COMPLETED result with reward 1.0 for a session: refused without the credential of that session's
    dispatch (a never-dispatched session has none), refused from the wrong node, accepted from its node."""
    server = start_server(tmp_path / "server.db")
    node = StandInNode("n1")
    try:
        with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as http:
            http.post("/rollout/task/submit", json=task("queued"))
            (queued,) = [s["session_id"] for s in http.get("/rollout/task/queued").json()["sessions"]]
            forged = {"session_id": queued, "task_id": "queued", "status": "COMPLETED", "reward": 1.0}
            r = http.post("/callbacks/session_result", json=forged)  # the shared token alone is not enough
            assert r.status_code == 403 and r.json()["error"]["param"] == RESULT_TOKEN_HEADER
            r = http.post(
                "/callbacks/session_result", json=forged, headers={RESULT_TOKEN_HEADER: new_token()}
            )
            assert r.status_code == 403

            node.register(http, server.url)
            http.post("/rollout/task/submit", json=task("real"))
            (sid,) = [s["session_id"] for s in http.get("/rollout/task/real").json()["sessions"]]
            credential = node.result_token(sid)
            other = {
                "session_id": sid,
                "task_id": "real",
                "status": "COMPLETED",
                "reward": 1.0,
                "node_id": "n2",
            }
            r = http.post("/callbacks/session_result", json=other, headers={RESULT_TOKEN_HEADER: credential})
            assert r.status_code == 403  # the right credential, claimed by another node
            assert http.get("/rollout/task/real").json()["state"] == "ACTIVE"
            r = node.report(http, server.url, {"session_id": sid, "task_id": "real", "status": "COMPLETED"})
            assert r.status_code == 200 and r.json()["outcome"] == "recorded"

            views = {t: http.get(f"/rollout/task/{t}").json() for t in ("queued", "real")}
            status = http.get("/rollout/status").json()
    finally:
        server.stop()
        node.stop()
    assert views["queued"]["state"] == "ACTIVE" and views["queued"]["results"] == []
    assert views["real"]["state"] == "DONE" and views["real"]["results"][0]["reward"] is None
    assert status["security"]["results_refused"] == 3
    kinds = [(e["kind"], e["session_id"]) for e in status["security"]["recent"]]
    assert kinds == [("result", queued), ("result", queued), ("result", sid)]


async def test_a_node_with_the_wrong_token_says_so_and_polar_status_shows_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(tmp_path / "server.db")
    caplog.set_level(logging.ERROR, logger="polar.node")
    try:
        with fake_policy() as (url, _):
            async with running_node(
                url, tmp_path, server_url=server.url, heartbeat_s=0.05, control_token=new_token()
            ):

                def refused() -> bool:
                    return any("refused this node's control token" in r.message for r in caplog.records)

                await eventually(lambda: asyncio.sleep(0, refused()), "the node to log the refusal")
                r = await asyncio.to_thread(
                    CliRunner().invoke, main, ["status", "--server", server.url], env={"POLAR_TOKEN": TOKEN}
                )
    finally:
        server.stop()
    assert r.exit_code == 0, r.output
    assert "refused: 1 request(s) with a missing or wrong control token" in r.output
    assert "POST /nodes/register" in r.output and "wrong control token" in r.output


async def test_a_node_that_refuses_the_servers_token_is_named_and_gets_no_session(tmp_path: Path) -> None:
    """A node whose control listener has another token: the dispatch is refused with 401, the session
    goes back to the queue, and `/nodes` and `polar status` say why."""
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(url, tmp_path, control_token=new_token()) as node,
                httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as http,
            ):
                reg = {"node_id": "odd", "url": node.control_url, "capacity": 2}
                assert (await http.post("/nodes/register", json=reg)).status_code == 200
                await http.post("/rollout/task/submit", json=task("t1"))

                async def named() -> dict[str, Any] | None:
                    (n,) = (await http.get("/nodes")).json()["nodes"]
                    return n if n["auth_error"] else None

                odd = await eventually(named, "the node's refusal to be recorded")
                counts = (await http.get("/rollout/task/t1")).json()["counts"]
                r = await asyncio.to_thread(
                    CliRunner().invoke, main, ["status", "--server", server.url], env={"POLAR_TOKEN": TOKEN}
                )
                assert node.status().active == 0
    finally:
        server.stop()
    assert odd["auth_error"].startswith("HTTP 401")
    assert counts in ({"REGISTERED": 1}, {"ERROR": 1})  # requeued, or ended after every node refused it
    assert "refuses our token" in r.output


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("builder", "os:system"),
        ("builder", "subprocess:Popen"),
        ("agent.harness", "os:system"),
        ("agent.harness", "subprocess:Popen"),
        ("evaluator.strategy", "os:system"),
        ("evaluator.strategy", "subprocess:Popen"),
    ],
)
def test_import_paths_from_the_network_are_refused_at_submit(tmp_path: Path, field: str, value: str) -> None:
    body: dict[str, Any] = task("t1")
    head, _, leaf = field.rpartition(".")
    (body.setdefault(head, {}) if head else body)[leaf] = value
    server = start_server(tmp_path / "server.db")
    try:
        with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as http:
            r = http.post("/rollout/task/submit", json=body)
            status = http.get("/rollout/status").json()
    finally:
        server.stop()
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert "import paths are not accepted from the network" in r.json()["error"]["message"]
    assert status["tasks"] == {}


async def test_the_node_and_the_gateway_refuse_import_paths_too(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            async with httpx.AsyncClient(
                base_url=node.control_url, headers={"authorization": f"Bearer {TOKEN}"}
            ) as http:
                bad = spec(shell_task("true").model_copy(update={"builder": "os:system"}), "sess-os")
                r = await http.post("/node/sessions", content=bad.model_dump_json())
                assert r.status_code == 422 and r.json()["error"]["field"] == "task.builder"
                route = {"harness": "os:system", "backend": {"url": "http://h", "model": "m"}}
                r = await http.post("/sessions", json={"metadata": {"side_call_route": route}})
                assert r.status_code == 400 and "not accepted from the network" in r.text
                sid = (await http.post("/sessions", json={})).json()["session_id"]
                r = await http.get(f"/sessions/{sid}/trajectory", params={"strategy": "os:system"})
                assert r.status_code == 400 and "unknown strategy 'os:system'" in r.text
            assert node.status().active == 0


def test_a_task_files_import_paths_resolve_next_to_it(tmp_path: Path) -> None:
    """The user's own file: `myeval:Judge` is `myeval.py` beside the file, from any working directory."""
    from polar.evaluate.registry import get_evaluator
    from polar.rollout.taskfile import TaskFileError, load_tasks

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "judge_beside.py").write_text(
        "class Judge:\n    name = 'judge'\n    needs_fresh_runtime = False\n"
        "    def __init__(self, config):\n        self.config = config\n"
        "    async def evaluate(self, ctx):\n        raise NotImplementedError\n"
    )
    (folder / "tasks.yaml").write_text(
        "task_id: t\ninstruction: x\nevaluator:\n  strategy: judge_beside:Judge\n  config: {k: 1}\n"
    )
    (tasks,) = [load_tasks(folder / "tasks.yaml")]
    assert get_evaluator(tasks[0].evaluator.strategy, {"k": 1}).name == "judge"
    (folder / "bad.yaml").write_text("task_id: t\ninstruction: x\nbuilder: nowhere_near:build\n")
    with pytest.raises(TaskFileError, match=r"bad.yaml:3: builder: cannot import nowhere_near"):
        load_tasks(folder / "bad.yaml")


def test_clients_find_the_token_or_say_how_to_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("POLAR_TOKEN", raising=False)
    with pytest.raises(TokenError, match="no control token: set POLAR_TOKEN"):
        RolloutClient("http://127.0.0.1:9")
    r = CliRunner().invoke(main, ["status", "--server", "http://127.0.0.1:9"])
    assert r.exit_code == 2 and "no control token" in r.output and "Traceback" not in r.output
    created = load_token(create=True)  # what `polar serve` does on first start
    token_file = tmp_path / "config" / "polar" / "token"
    assert token_file.read_text().strip() == created and token_file.stat().st_mode & 0o777 == 0o600
    assert load_token() == created  # a client on the same machine finds it
    monkeypatch.setenv("POLAR_TOKEN", "short")
    with pytest.raises(TokenError, match="at least 16 characters"):
        load_token()


def test_the_result_credential_never_reaches_results(tmp_path: Path) -> None:
    """The dispatch credential is a secret between server and node: not in results, task views or events."""
    server = start_server(tmp_path / "server.db")
    node = StandInNode()
    try:
        with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as http:
            node.register(http, server.url)
            http.post("/rollout/task/submit", json=task("t1"))
            (sid,) = [s["session_id"] for s in http.get("/rollout/task/t1").json()["sessions"]]
            credential = node.result_token(sid)
            node.report(http, server.url, {"session_id": sid, "task_id": "t1", "status": "COMPLETED"})
            wait_until(lambda: http.get("/rollout/task/t1").json()["state"] == "DONE", what="the task")
            texts = [http.get("/rollout/task/t1").text, http.get("/rollout/results?task=t1").text]
    finally:
        server.stop()
        node.stop()
    assert all(credential not in text for text in texts)
