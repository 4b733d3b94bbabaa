"""`polar.client.RolloutClient` against a real server (and a real node where sessions must run)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.client import RolloutClient, RolloutError
from polar.rollout.protocol import SessionResult
from polar.serving import free_port
from polar.task import Task
from tests.node_support import eventually, fake_policy, running_node
from tests.server_support import AUTH, TOKEN, StandInNode, start_server


def _task(task_id: str, n: int = 1, **fields: Any) -> Task:
    return Task.model_validate({"task_id": task_id, "instruction": "x", "num_samples": n, **fields})


def _shell(task_id: str, command: str, n: int = 1) -> Task:
    return _task(task_id, n, agent={"harness": "shell", "settings": {"command": command}}, timeout_seconds=60)


def _node(url: str) -> StandInNode:
    with httpx.Client(headers=AUTH) as http:
        return StandInNode().register(http, url)


async def _report(
    node: StandInNode, url: str, session_id: str, task_id: str, status: str = "COMPLETED"
) -> None:
    """What a node posts when a session ends (with the credential of the session's dispatch)."""

    def post() -> httpx.Response:
        with httpx.Client(headers=AUTH) as http:
            body = {"session_id": session_id, "task_id": task_id, "status": status, "reward": 1.0}
            return node.report(http, url, body)

    r = await asyncio.to_thread(post)
    assert r.status_code == 200, r.text


class CountingClient(RolloutClient):
    """Records how many groups were unfinished each time one was submitted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight_at_submit: list[int] = []

    async def _post_tasks(self, tasks: list[Task]) -> None:
        self.in_flight_at_submit.append(len(self.in_flight))
        await super()._post_tasks(tasks)


async def test_run_streams_every_result_with_bounded_groups_in_flight(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")
    try:
        with fake_policy() as (url, _):
            async with (
                running_node(url, tmp_path, server_url=server.url, heartbeat_s=0.05, capacity=8),
                CountingClient(server.url, token=TOKEN, max_in_flight=2, poll_wait_s=2) as client,
            ):
                await eventually(lambda: _healthy(server.url), "the node")
                tasks = [_shell(f"g{i}", "true", n=2) for i in range(5)]
                results = [r async for r in client.run(tasks)]
    finally:
        server.stop()
    assert sorted((r.task_id, r.metadata["sample_index"]) for r in results) == [
        (f"g{i}", k) for i in range(5) for k in range(2)
    ]
    assert all(r.status == "COMPLETED" and r.node_id == "node-test" for r in results)
    assert len({r.session_id for r in results}) == 10
    assert client.in_flight_at_submit[:2] == [0, 1] and max(client.in_flight_at_submit) <= 1
    assert client.in_flight == set()


async def _healthy(url: str) -> bool:
    async with httpx.AsyncClient(headers=AUTH) as http:
        nodes = (await http.get(f"{url}/nodes")).json()["nodes"]
    return bool(nodes) and bool(nodes[0]["healthy"])


async def test_results_yield_each_session_as_it_finishes(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")
    node = _node(server.url)
    try:
        async with RolloutClient(server.url, token=TOKEN, poll_wait_s=5) as client:
            assert await client.submit([_task("a", 2), _task("b")]) == ["a", "b"]
            a0, a1 = client.session_ids["a"]
            (b0,) = client.session_ids["b"]
            stream = client.results(["a", "b"])
            await _report(node, server.url, a1, "a")
            first = await anext(stream)  # arrives before anything else has finished
            assert (first.session_id, first.status) == (a1, "COMPLETED")
            await _report(node, server.url, b0, "b", "ERROR")
            assert (await anext(stream)).session_id == b0
            await _report(node, server.url, a0, "a", "TIMEOUT")
            assert (await anext(stream)).session_id == a0
            with pytest.raises(StopAsyncIteration):
                await anext(stream)
            assert (await client.task("a"))["state"] == "DONE"
            assert (await client.status())["tasks"] == {"DONE": 2}
    finally:
        server.stop()
        node.stop()


async def test_cancel_and_refusals(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")
    try:
        async with RolloutClient(server.url, token=TOKEN) as client:
            await client.submit(_task("c", 3))
            assert await client.cancel("c") is True
            assert await client.cancel("c") is False
            results = [r async for r in client.results("c")]
            assert [r.status for r in results] == ["CANCELLED"] * 3
            with pytest.raises(RolloutError) as err:
                await client.submit(_task("bad", agent={"harness": "no-such-agent"}))
            assert err.value.status == 400 and err.value.param == "tasks[0].agent.harness"
            with pytest.raises(RolloutError) as err:
                await client.submit(_task("c"))
            assert err.value.status == 409
            with pytest.raises(RolloutError) as err:
                await client.cancel("missing")
            assert err.value.status == 404
            with pytest.raises(RolloutError):
                await client.task("missing")
    finally:
        server.stop()
    with pytest.raises(ValueError, match="max_in_flight"):
        RolloutClient(server.url, token=TOKEN, max_in_flight=0)


async def test_results_ride_out_a_server_restart(tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "server.db"
    server = start_server(db, port=port)
    node = _node(server.url)
    async with RolloutClient(server.url, token=TOKEN, poll_wait_s=1, retry_window_s=30) as client:
        await client.submit(_task("r", 2))
        s0, s1 = client.session_ids["r"]
        await _report(node, server.url, s0, "r")
        stream = client.results("r")
        assert (await anext(stream)).session_id == s0
        server.stop()
        pending = asyncio.create_task(anext(stream))  # polls a server that is down
        await asyncio.sleep(0.2)
        assert not pending.done()
        server = await asyncio.to_thread(start_server, db, port)
        try:
            await _report(node, server.url, s1, "r")
            assert (await pending).session_id == s1
        finally:
            server.stop()
            node.stop()


def test_run_sync_from_plain_code(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server.db")
    stop = threading.Event()

    node = _node(server.url)

    def node_like() -> None:
        """Finishes every session dispatched to it, as a node's report would."""
        reported: set[str] = set()
        with httpx.Client(headers=AUTH) as http:
            while not stop.is_set():
                for sid, spec in list(node.specs.items()):
                    if sid not in reported:
                        body = {"session_id": sid, "task_id": spec.task.task_id, "status": "COMPLETED"}
                        node.report(http, server.url, body)
                        reported.add(sid)
                stop.wait(0.02)

    thread = threading.Thread(target=node_like, daemon=True)
    thread.start()
    try:
        results = RolloutClient.run_sync(
            server.url, [_task("s1", 2), _task("s2")], token=TOKEN, max_in_flight=1
        )
    finally:
        stop.set()
        thread.join()
        server.stop()
        node.stop()
    assert sorted(r.task_id for r in results) == ["s1", "s1", "s2"]
    assert all(isinstance(r, SessionResult) for r in results)
