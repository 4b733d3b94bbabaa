"""Server events for dashboards: an in-process fan-out and its SSE rendering (`GET /events`).

Events are a live view, not a log: a subscriber that falls `queue_size` events behind loses the oldest
ones (and is told how many), so a stalled dashboard never holds memory or slows the server. Durable
state is read from `GET /rollout/task/{id}`.

Kinds: task_submitted, task_done, session_dispatched, session_stage, session_requeued, session_result,
session_held and group_judging (a `judge_group` task's results wait for its group: `grouping`),
node_registered, node_draining, node_left, node_lost, callback_failed (and `dropped`, to a subscriber that fell behind).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson


class Subscriber:
    def __init__(self, queue_size: int, kinds: frozenset[str] | None) -> None:
        self.queue: asyncio.Queue[tuple[int, str, dict[str, Any]]] = asyncio.Queue(queue_size)
        self.kinds = kinds
        self.dropped = 0

    def offer(self, event: tuple[int, str, dict[str, Any]]) -> None:
        if self.kinds is not None and event[1] not in self.kinds:
            return
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(event)


class EventBus:
    def __init__(self, queue_size: int = 1000) -> None:
        self.queue_size = queue_size
        self._subs: set[Subscriber] = set()
        self._ids = itertools.count(1)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def publish(self, kind: str, **data: Any) -> None:
        event = (next(self._ids), kind, {"ts": time.time(), **data})
        for sub in list(self._subs):
            sub.offer(event)

    def subscribe(self, kinds: frozenset[str] | None = None) -> Subscriber:
        sub = Subscriber(self.queue_size, kinds)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subs.discard(sub)


def sse_frame(event_id: int, kind: str, data: dict[str, Any]) -> bytes:
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (event_id, kind.encode(), orjson.dumps(data))


async def sse_stream(bus: EventBus, sub: Subscriber, keepalive_s: float = 15.0) -> AsyncIterator[bytes]:
    """Frames for one subscriber until the client goes away. A comment line every `keepalive_s` keeps
    proxies from closing an idle stream (and lets the server notice a vanished client)."""
    try:
        yield b": polar events\n\n"
        while True:
            try:
                async with asyncio.timeout(keepalive_s):
                    event_id, kind, data = await sub.queue.get()
            except TimeoutError:
                yield b": keepalive\n\n"
                continue
            if sub.dropped:
                yield sse_frame(0, "dropped", {"count": sub.dropped})
                sub.dropped = 0
            yield sse_frame(event_id, kind, data)
    finally:
        bus.unsubscribe(sub)
