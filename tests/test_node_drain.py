"""Graceful drain with a real server and real nodes: `polar node drain` stops new placements, hands the
sessions whose agent has not started back to the server (they run on another node, same id, once), lets
running ones finish and report, and the node leaves; a drain's timeout cancels what still runs."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from polar.cli import main
from polar.rollout.node import AdmissionError
from polar.rollout.protocol import SessionStatus
from polar.rollout.server.store import ServerStore
from tests.node_support import (
    ON_HOST,
    control_client,
    eventually,
    fake_policy,
    pids_under,
    running_node,
    shell_task,
    spec,
    until,
)
from tests.server_support import AUTH, TOKEN, start_server


def _blocking(runs: Path, gate: Path) -> str:
    return f'echo "$POLAR_SESSION_ID" >> {runs}; while [ ! -f {gate} ]; do sleep 0.05; done'


async def _nodes(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = (await client.get("/nodes")).json()["nodes"]
    return nodes


async def test_polar_node_drain_hands_back_finishes_and_leaves(tmp_path: Path) -> None:
    runs, gate = tmp_path / "runs", tmp_path / "go"
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            common: dict[str, Any] = {"server_url": server.url, "heartbeat_s": 0.05}
            async with contextlib.AsyncExitStack() as stack:
                # one run slot: of the two sessions, one runs and one waits READY (a prepared runtime)
                a = await stack.enter_async_context(
                    running_node(url, tmp_path / "a", node_id="a", capacity=2, run_workers=1, **common)
                )
                client = await stack.enter_async_context(
                    httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH)
                )
                await eventually(lambda: _nodes(client), "node a to register")
                task = {
                    "task_id": "drain",
                    "instruction": "x",
                    "num_samples": 2,
                    "agent": {"harness": "shell", "settings": {"command": _blocking(runs, gate)}},
                    "runtime": ON_HOST,
                }
                assert (await client.post("/rollout/task/submit", json=task)).status_code == 201
                await until(
                    lambda: a.status().by_stage == {"RUNNING": 1, "READY": 1}, "one running, one READY"
                )
                (running,) = [s.session_id for s in a.sessions() if s.status == SessionStatus.RUNNING]
                b = await stack.enter_async_context(running_node(url, tmp_path / "b", node_id="b", **common))

                async def two() -> bool:
                    return len(await _nodes(client)) == 2

                await eventually(two, "node b to register")
                argv = ["node", "drain", "a", "--server", server.url]
                cli = asyncio.create_task(
                    asyncio.to_thread(CliRunner().invoke, main, argv, env={"POLAR_TOKEN": TOKEN})
                )
                await until(lambda: b.status().by_stage.get("RUNNING") == 1, "the handed-back session on b")
                assert a.status().draining and a.status().by_stage == {"RUNNING": 1}
                (a_row,) = [n for n in await _nodes(client) if n["node_id"] == "a"]
                assert a_row["draining"] is True
                with pytest.raises(AdmissionError) as refused:  # no new session while draining
                    await a.submit(spec(shell_task("true"), "sess-late"))
                gate.touch()  # the running session finishes on a, the handed-back one on b
                result = await cli
                view = (await client.get("/rollout/task/drain")).json()
                left = await _nodes(client)
                # The command returns once the server has let the node go; the node then stops itself
                # (servers, store), a moment later.
                await until(lambda: a.journal is None, "node a to stop after leaving")
    finally:
        server.stop()
    assert refused.value.status == 503
    assert result.exit_code == 0, result.output
    assert "draining" in result.output and "node a: left" in result.output
    assert [n["node_id"] for n in left] == ["b"]
    assert view["state"] == "DONE"
    by_id = {s["session_id"]: s for s in view["sessions"]}
    assert {r["status"] for r in view["results"]} == {"COMPLETED"}
    assert by_id[running]["node_id"] == "a"
    (handed,) = [sid for sid in by_id if sid != running]
    assert by_id[handed]["node_id"] == "b"
    assert sorted(runs.read_text().split()) == sorted(by_id)  # each agent ran once
    store = ServerStore(tmp_path / "server.db")
    try:
        session = store.session(handed)
    finally:
        store.close()
    assert session is not None and session.attempts == 1  # the hand-back did not count as an attempt


async def test_a_drain_timeout_cancels_what_still_runs(tmp_path: Path) -> None:
    """Standalone: the READY session is handed back (no server: it just ends here, its runtime stopped),
    the running one is cancelled when the drain's time is up, its processes killed, and the node stops."""
    runs, gate = tmp_path / "runs", tmp_path / "never"
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path, capacity=2, run_workers=1) as node:
            await node.submit(spec(shell_task(_blocking(runs, gate), runtime=ON_HOST), "sess-run"))
            await until(lambda: node.status().by_stage == {"RUNNING": 1}, "the first to run")
            await node.submit(spec(shell_task(_blocking(runs, gate), runtime=ON_HOST), "sess-ready"))
            await until(lambda: node.status().by_stage.get("READY") == 1, "the second to wait READY")
            await node.drain("maintenance", timeout_s=0.3)
            cancelled = node.state("sess-run")
            handed = node.state("sess-ready")
            with pytest.raises(AdmissionError):
                await node.submit(spec(shell_task("true"), "sess-after"))
    assert cancelled is not None and cancelled.status == SessionStatus.CANCELLED
    assert cancelled.result is not None and "maintenance" in (cancelled.result.reason or "")
    assert handed is None  # not here: handed back
    assert runs.read_text().split() == ["sess-run"]  # the READY one's agent never started
    await until(lambda: not pids_under(tmp_path / "runtimes"), "the cancelled agent to die")


async def test_node_drain_route_needs_a_valid_body(tmp_path: Path) -> None:
    with fake_policy() as (url, _):
        async with running_node(url, tmp_path) as node, control_client(node) as client:
            bad = await client.post("/node/drain", json={"timeout_s": -1})
            assert bad.status_code == 422 and bad.json()["error"]["field"] == "timeout_s"
            assert not node.draining
            ok = await client.post("/node/drain", json={"reason": "upgrade"})
            assert ok.status_code == 202 and ok.json()["draining"] is True
            await until(lambda: node.journal is None, "the idle node to drain and stop")


def test_polar_node_drain_help_and_an_unknown_node(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["node", "drain", "--help"])
    assert r.exit_code == 0 and "polar node drain node-gpu3" in r.output
    server = start_server(tmp_path / "server.db")
    try:
        r = CliRunner().invoke(
            main, ["node", "drain", "ghost", "--server", server.url], env={"POLAR_TOKEN": TOKEN}
        )
    finally:
        server.stop()
    assert r.exit_code == 2 and "no node ghost" in r.output


async def test_an_idle_node_drained_through_the_server_leaves(tmp_path: Path) -> None:
    """Nothing runs, so the drain's `beat_now()` and its cancel of the heartbeat task fall in one pass of
    the loop. On Python 3.11 `asyncio.wait_for` swallowed that cancel (its inner wait had just completed):
    the heartbeat went on and the node never left."""
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(url, tmp_path, server_url=server.url, heartbeat_s=5.0, node_id="idle") as node,
                httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
            ):

                async def registered() -> bool:
                    return len(await _nodes(client)) == 1

                await eventually(registered, "the node to register")
                r = await client.post("/nodes/idle/drain", json={})
                assert r.status_code == 202, r.text
                await until(lambda: node.journal is None, "the idle node to drain, leave and stop")
                left = await _nodes(client)
    finally:
        server.stop()
    assert left == []
