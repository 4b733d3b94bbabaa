"""`GET /events`: the server's live event stream (SSE), read with httpx like a dashboard would."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.server_support import AUTH, StandInNode, start_server, task


async def _read_events(lines: Any, until: str) -> list[tuple[str, dict[str, Any]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    kind = None
    async for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: ") and kind is not None:
            events.append((kind, orjson.loads(line.removeprefix("data: "))))
            if kind == until:
                return events
    raise AssertionError("stream ended early")


async def test_events_stream_task_lifecycle(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "s.db")
    node = StandInNode()
    sync_http = httpx.Client(headers=AUTH)
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30, headers=AUTH) as http:
            kinds_q = {"kinds": "task_submitted,session_dispatched,session_result,task_done"}
            async with http.stream("GET", "/events", params=kinds_q) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                await asyncio.to_thread(node.register, sync_http, srv.url)
                await http.post("/rollout/task/submit", json=task("t1", num_samples=1))
                lines = stream.aiter_lines()
                # The node reports only once it was given the session (reported earlier, the result would
                # land before the dispatch is published: seen in CI).
                events = await _read_events(lines, until="session_dispatched")
                sid = events[-1][1]["session_id"]
                body = {"session_id": sid, "task_id": "t1", "status": "COMPLETED", "reward": 0.5}
                r = await asyncio.to_thread(node.report, sync_http, srv.url, body)
                assert r.status_code == 200, r.text
                events += await _read_events(lines, until="task_done")
            kinds = [k for k, _ in events]
            assert kinds == ["task_submitted", "session_dispatched", "session_result", "task_done"]
            assert events[2][1]["session_id"] == sid and events[2][1]["reward"] == 0.5
            assert events[3][1]["counts"] == {"COMPLETED": 1}

            # a filtered stream sees only the kinds it asked for
            async with http.stream("GET", "/events", params={"kinds": "task_done"}) as stream:
                await http.post("/rollout/task/submit", json=task("t2"))
                await http.delete("/rollout/task/t2")
                events = await _read_events(stream.aiter_lines(), until="task_done")
            assert [k for k, _ in events] == ["task_done"] and events[0][1]["state"] == "CANCELLED"
    finally:
        srv.stop()
        node.stop()
        sync_http.close()


def test_a_slow_subscriber_loses_old_events_not_memory() -> None:
    from polar.rollout.server.events import EventBus

    bus = EventBus(queue_size=3)
    sub = bus.subscribe()
    for i in range(10):
        bus.publish("tick", i=i)
    assert sub.dropped == 7 and sub.queue.qsize() == 3
    assert [sub.queue.get_nowait()[2]["i"] for _ in range(3)] == [7, 8, 9]
    bus.unsubscribe(sub)
    assert bus.subscribers == 0
