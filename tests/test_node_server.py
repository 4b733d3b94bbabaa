"""The node with the real rollout server: registration and heartbeats, sessions dispatched by the server,
results delivered to its callback (retried through a server restart), early stop cancelling stragglers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from polar.serving import free_port
from polar.serving import urls as _urls
from tests.node_support import (
    PY,
    eventually,
    fake_policy,
    pids_under,
    running_node,
    shell_task,
    spec,
    until,
    write_caller,
)
from tests.server_support import AUTH, start_server


def _task(task_id: str, command: str, **fields: Any) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "instruction": "do it",
        "timeout_seconds": 60,
        "agent": {"harness": "shell", "settings": {"command": command}},
        # These sessions coordinate with the test through host files (gates, pid files): a trusted program
        # on the host's files, which only `local` gives (a sandbox sees none of the test's tmp_path).
        "runtime": {"backend": "local"},
        **fields,
    }


def _view(client: httpx.AsyncClient, task_id: str, done: Any = None) -> Any:
    """A check for `eventually`: the task's view once `done(view)` holds."""

    async def check() -> dict[str, Any] | None:
        r = await client.get(f"/rollout/task/{task_id}")
        assert r.status_code == 200, r.text
        view: dict[str, Any] = r.json()
        return view if done is None or done(view) else None

    return check


def _all_terminal(view: dict[str, Any]) -> bool:
    return all(s["status"] in ("COMPLETED", "ERROR", "TIMEOUT", "CANCELLED") for s in view["sessions"])


async def _registered(client: httpx.AsyncClient) -> list[dict[str, Any]] | None:
    nodes: list[dict[str, Any]] = (await client.get("/nodes")).json()["nodes"]
    return nodes if nodes and nodes[0]["healthy"] else None


async def test_sessions_dispatched_by_the_server_complete_and_report(tmp_path: Path) -> None:
    caller = write_caller(tmp_path)
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, fake):
            async with (
                running_node(url, tmp_path, server_url=server.url, heartbeat_s=0.05, capacity=4) as node,
                httpx.AsyncClient(base_url=server.url, headers=AUTH) as client,
            ):
                nodes = await eventually(lambda: _registered(client), "registration")
                assert nodes[0]["node_id"] == "node-test" and nodes[0]["url"] == node.control_url
                metadata = {"group_id": "grp-7", "policy_version": 3}
                body = _task("srv-t1", f"{PY} {caller}", num_samples=3, metadata=metadata)
                r = await client.post("/rollout/task/submit", json=body)
                assert r.status_code == 201, r.text
                view = await eventually(_view(client, "srv-t1", _all_terminal), "the task")
                sids = [s["session_id"] for s in view["sessions"]]
                await until(lambda: all(node.reporter.delivered.get(sid) for sid in sids), "deliveries")
    finally:
        server.stop()
    assert [s["status"] for s in view["sessions"]] == ["COMPLETED"] * 3
    assert {s["node_id"] for s in view["sessions"]} == {"node-test"}
    assert len(view["results"]) == 3 and len(fake.requests) == 3
    for res in view["results"]:
        assert res["reward"] == 1.0 and res["trajectory"]["traces"]
        assert res["trajectory"]["metadata"]["group_id"] == "grp-7"
        assert res["trajectory"]["metadata"]["policy_version"] == 3


async def test_the_servers_stage_counts_follow_each_session_without_waiting_a_heartbeat(
    tmp_path: Path,
) -> None:
    """Was: a node's stage counts reached the server (and the dashboard) only with its next heartbeat, so it
    showed "running 2" with nothing running. Heartbeats every 600 s here: only the stage changes send them."""
    caller = write_caller(tmp_path)
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(url, tmp_path, server_url=server.url, heartbeat_s=600, capacity=2),
                httpx.AsyncClient(base_url=server.url, headers=AUTH) as client,
            ):
                await eventually(lambda: _registered(client), "registration")
                body = _task("stages", f"sleep 2; {PY} {caller}", num_samples=2)
                assert (await client.post("/rollout/task/submit", json=body)).status_code == 201

                async def stage_counts() -> dict[str, int] | None:
                    (node,) = (await client.get("/nodes")).json()["nodes"]
                    return (node.get("status") or {}).get("by_stage")

                async def running() -> bool | None:
                    return bool((await stage_counts() or {}).get("RUNNING")) or None

                await eventually(running, "the server to see the sessions running")
                await eventually(_view(client, "stages", _all_terminal), "the task")

                async def emptied() -> bool | None:
                    return (await stage_counts()) == {} or None

                await eventually(emptied, "the node's stage counts to empty after its sessions ended")
    finally:
        server.stop()


async def test_result_delivery_is_retried_through_a_server_restart(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    port = free_port()
    server = start_server(tmp_path / "server.db", port=port)
    restarted = None
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(
                    url,
                    tmp_path,
                    server_url=server.url,
                    heartbeat_s=0.05,
                    report_backoff_s=0.05,
                    report_attempts=10,
                ) as node,
                httpx.AsyncClient(base_url=server.url, headers=AUTH) as client,
            ):
                await eventually(lambda: _registered(client), "registration")
                command = f"while [ ! -f {gate} ]; do sleep 0.05; done"
                assert (
                    await client.post("/rollout/task/submit", json=_task("srv-t2", command))
                ).status_code == 201
                await until(lambda: node.status().by_stage.get("RUNNING") == 1, "the session to run")
                server.stop()
                gate.touch()
                await until(lambda: node.status().active == 0, "the session to finish")
                (sid,) = [s.session_id for s in node.sessions()]
                assert sid not in node.reporter.delivered  # still trying: the server is down
                restarted = start_server(tmp_path / "server.db", port=port)
                await until(lambda: node.reporter.delivered.get(sid) is True, "delivery after the restart")
                view = await eventually(_view(client, "srv-t2", _all_terminal), "the task")
    finally:
        (restarted or server).stop()
    assert view["sessions"][0]["status"] == "COMPLETED"
    assert view["results"][0]["reward"] == 1.0


async def test_early_stop_cancels_stragglers_on_the_node(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    # The first session to run (mkdir is atomic) finishes once the two others hang with a child process.
    first = f"mkdir {tmp_path}/first 2>/dev/null && {{ until [ $(ls {pids} | wc -l) = 2 ]; do sleep 0.05; done; exit 0; }}"
    command = (
        f"{first}; sleep 60 & mktemp {pids}/agent.XXXXXX >/dev/null; wait"  # ($$ is 2 in every PID namespace)
    )
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(url, tmp_path, server_url=server.url, heartbeat_s=0.05, capacity=3) as node,
                httpx.AsyncClient(base_url=server.url, headers=AUTH) as client,
            ):
                await eventually(lambda: _registered(client), "registration")
                body = _task("srv-t3", command, num_samples=3, early_stop_min_usable=1)
                r = await client.post("/rollout/task/submit", json=body)
                assert r.status_code == 201, r.text
                view = await eventually(_view(client, "srv-t3", _all_terminal), "the task")
                await until(lambda: node.status().active == 0, "the node to settle")
    finally:
        server.stop()
    statuses = sorted(s["status"] for s in view["sessions"])
    assert statuses == ["CANCELLED", "CANCELLED", "COMPLETED"]
    assert len(list(pids.iterdir())) == 2
    await until(lambda: not pids_under(tmp_path / "runtimes", "sleep", "60"), "the stragglers to die")


async def test_a_result_the_server_refuses_is_not_retried_and_stays_on_the_node(tmp_path: Path) -> None:
    """A session the server never created (submitted to the node directly): the server answers 404, the
    node stops trying at once (no retry can fix that) and keeps the result for GET."""
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            async with running_node(url, tmp_path, report_backoff_s=5.0) as node:
                await node.submit(spec(shell_task("true"), "sess-stray", server_url=server.url))
                await node.wait("sess-stray")
                await until(lambda: "sess-stray" in node.reporter.delivered, "the delivery attempt")
                assert node.reporter.delivered["sess-stray"] is False
                state = node.state("sess-stray")
    finally:
        server.stop()
    assert state is not None and state.result is not None and state.result.status == "COMPLETED"


def test_urls_for_bound_hosts() -> None:
    assert _urls("127.0.0.1", 8200) == ("http://127.0.0.1:8200", "http://127.0.0.1:8200")
    local, public = _urls("0.0.0.0", 8200)
    assert local == "http://127.0.0.1:8200" and public.endswith(":8200") and "0.0.0.0" not in public
    assert _urls("::1", 9) == ("http://[::1]:9", "http://[::1]:9")
