"""The node's journal: a dispatch resent after a lost reply is answered "duplicate" and runs once, a refused
dispatch (full, or a probe that found nothing) stays refused while another dispatch of the same id may be
admitted, tombstones expire and owed outcomes do not, and a node restarted on its store reports what its
predecessor could not deliver."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from polar.rollout.node.journal import RESTARTED, Journal, State
from polar.rollout.protocol import RESULT_TOKEN_HEADER, SessionResult, SessionStatus
from polar.serving import free_port
from tests.node_support import (
    ON_HOST,
    control_client,
    eventually,
    fake_policy,
    running_node,
    shell_task,
    spec,
    until,
)
from tests.server_support import AUTH, start_server


def _dispatch(session_id: str, token: str, command: str = "true") -> dict[str, Any]:
    return spec(shell_task(command, runtime=ON_HOST), session_id, result_token=token).model_dump(mode="json")


async def _registered(client: httpx.AsyncClient) -> bool:
    return bool((await client.get("/nodes")).json()["nodes"])


def _runs(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def test_a_resent_dispatch_is_answered_duplicate_and_runs_once(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    command = f'echo "$POLAR_SESSION_ID" >> {runs}'
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node, control_client(node) as client:
            first = await client.post("/node/sessions", json=_dispatch("sess-dup", "tok-1", command))
            resent = await client.post("/node/sessions", json=_dispatch("sess-dup", "tok-1", command))
            await node.wait("sess-dup")
            after_end = await client.post("/node/sessions", json=_dispatch("sess-dup", "tok-1", command))
            other = await client.post("/node/sessions", json=_dispatch("sess-dup", "tok-2", command))
    assert first.status_code == 202 and first.json()["duplicate"] is False
    assert resent.status_code == 202 and resent.json()["duplicate"] is True
    assert after_end.status_code == 202 and after_end.json()["duplicate"] is True
    assert other.status_code == 409  # another dispatch of a spent id: single use
    assert _runs(runs) == ["sess-dup"]


async def test_a_refused_dispatch_stays_refused_and_another_dispatch_of_the_id_may_run(
    tmp_path: Path,
) -> None:
    """Full (429): that dispatch is fenced, so its copy arriving once there is room is refused; the server's
    next dispatch of the same id (a new token) is admitted."""
    gate = tmp_path / "go"
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, capacity=1) as node, control_client(node) as client:
            block = f"while [ ! -f {gate} ]; do sleep 0.05; done"
            assert (
                await client.post("/node/sessions", json=_dispatch("blocker", "b", block))
            ).status_code == 202
            full = await client.post("/node/sessions", json=_dispatch("sess-x", "tok-1"))
            gate.touch()
            await node.wait("blocker")
            late_copy = await client.post("/node/sessions", json=_dispatch("sess-x", "tok-1"))
            redispatch = await client.post("/node/sessions", json=_dispatch("sess-x", "tok-2"))
            result = await node.wait("sess-x")
    assert full.status_code == 429
    assert late_copy.status_code == 409 and "refused" in late_copy.json()["error"]["message"]
    assert redispatch.status_code == 202 and result.status == SessionStatus.COMPLETED


async def test_a_probe_naming_its_dispatch_fences_it(tmp_path: Path) -> None:
    """The server asks about a dispatch whose answer it lost: the node answers 404 and from then on never
    admits that dispatch (the server requeues the session on that answer). A probe without a token is a
    plain read."""
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node, control_client(node) as client:
            probe = await client.get("/node/sessions/sess-p", headers={RESULT_TOKEN_HEADER: "tok-1"})
            late = await client.post("/node/sessions", json=_dispatch("sess-p", "tok-1"))
            plain = await client.get("/node/sessions/sess-q")
            admitted_q = await client.post("/node/sessions", json=_dispatch("sess-q", "tok-1"))
            again = await client.post("/node/sessions", json=_dispatch("sess-p", "tok-2"))
            await node.wait("sess-p")
            await node.wait("sess-q")
    assert probe.status_code == 404 and late.status_code == 409
    assert plain.status_code == 404 and admitted_q.status_code == 202
    assert again.status_code == 202


async def test_a_404_is_not_here_only_from_the_node_the_session_is_bound_to(tmp_path: Path) -> None:
    """A restarted node listens on new ports; until it registers them, its old address may be another
    listener (seen in CI: its own model API took the old control port) whose 404 knows nothing of the
    session. The server's probe reads a 404 as "not here" only when the node it asked names itself."""
    from polar.rollout.server.nodelink import NodeLink

    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node:
            link = NodeLink(10.0, node.config.gateway.control_token)
            try:
                bound = await link.probe(node.control_url, node.node_id, "sess-x")
                other = await link.probe(node.control_url, "node-elsewhere", "sess-x")
                model_api = await link.probe(node.url, node.node_id, "sess-x")
            finally:
                await link.aclose()
    assert bound.reachable and bound.state is None
    assert not other.reachable and other.error is not None and "not node-elsewhere" in other.error
    assert not model_api.reachable and model_api.state is None


def test_tombstones_expire_and_owed_outcomes_do_not(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "node.db")
    try:
        journal.fence("fenced", "t")
        journal.admit("settled", "t", "task", "http://server")
        journal.end(SessionResult(session_id="settled", task_id="task", status="COMPLETED"), owed=True)
        journal.settle("settled")
        journal.admit("owed", "t", "task", "http://server")
        journal.end(SessionResult(session_id="owed", task_id="task", status="COMPLETED"), owed=True)
        journal.admit("running", "t", "task", "http://server")
        assert journal.prune(ttl_s=3600) == 0  # young tombstones stay
        assert journal.prune(ttl_s=3600, now=time.time() + 7200) == 2
        owed = journal.get("owed")
        assert owed is not None and owed.state is State.ENDED and owed.result is not None
        assert journal.get("running") is not None and journal.get("fenced") is None
        # a node starting on this store: the session left admitted ended ERROR, owed to its server
        (interrupted,) = journal.interrupted("node-x")
        entry = journal.get("running")
        assert interrupted.session_id == "running" and entry is not None and entry.state is State.ENDED
        assert entry.result is not None and entry.result.status == SessionStatus.ERROR
        assert entry.result.reason == RESTARTED
        assert [e.session_id for e in journal.owed()] == ["owed", "running"]
    finally:
        journal.close()


async def test_a_restarted_node_reports_what_its_predecessor_could_not_deliver(tmp_path: Path) -> None:
    """The session ends while the server is down and the node gives up delivering; the node stops. A node
    started on the same store (same id) finds the outcome in its journal and reports it."""
    gate = tmp_path / "go"
    port = free_port()
    server = start_server(tmp_path / "server.db", port=port, audit_interval_s=3600)
    restarted = None
    try:
        with fake_policy() as (url, _):
            kw: dict[str, Any] = {"heartbeat_s": 0.05, "report_attempts": 1, "report_backoff_s": 0.05}
            async with (
                running_node(url, tmp_path, server_url=server.url, **kw) as node,
                httpx.AsyncClient(base_url=server.url, headers=AUTH) as client,
            ):
                await eventually(lambda: _registered(client), "registration")
                command = f"while [ ! -f {gate} ]; do sleep 0.05; done"
                task = {"task_id": "jr", "instruction": "x", "agent": {"harness": "shell", "settings": {"command": command}}, "runtime": ON_HOST}  # fmt: skip
                assert (await client.post("/rollout/task/submit", json=task)).status_code == 201
                await until(lambda: node.status().by_stage.get("RUNNING") == 1, "the session to run")
                (sid,) = [s.session_id for s in node.sessions()]
                server.stop()
                gate.touch()
                await until(lambda: node.reporter.delivered.get(sid) is False, "the delivery to fail")
            assert node.journal is None  # closed with the node; the outcome stays owed on disk
            journal = Journal(tmp_path / "node.db")
            owed = journal.get(sid)
            journal.close()
            assert owed is not None and owed.state is State.ENDED
            restarted = start_server(tmp_path / "server.db", port=port, audit_interval_s=3600)
            async with (
                running_node(url, tmp_path, server_url=restarted.url, **kw) as node,
                httpx.AsyncClient(base_url=restarted.url, headers=AUTH) as client,
            ):
                await until(lambda: node.reporter.delivered.get(sid) is True, "the report after the restart")

                async def done() -> dict[str, Any] | None:
                    view: dict[str, Any] = (await client.get("/rollout/task/jr")).json()
                    return view if view["state"] == "DONE" else None

                view = await eventually(done, "the task")
                assert node.journal is not None
                settled = node.journal.get(sid)
    finally:
        (restarted or server).stop()
    assert view["sessions"][0]["status"] == "COMPLETED" and view["results"][0]["reward"] == 1.0
    assert settled is not None and settled.state is State.SETTLED and settled.result is None
