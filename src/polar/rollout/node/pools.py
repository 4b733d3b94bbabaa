"""Bounded worker pools, one per stage, and the bounded READY buffer.

Each stage has its own limit so that CPU-heavy setup (INIT) and long-tail evaluation (POSTRUN) never take
a run slot from an agent waiting on the GPU-bound policy. Waiters are served first come, first served.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class StagePool:
    """At most `size` holders at once; counts holders and waiters for the node's status."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self._sem = asyncio.Semaphore(size)
        self.busy = 0
        self.waiting = 0
        self.peak = 0  # the most holders ever at once (the bound is checked against it)

    async def acquire(self) -> None:
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.busy += 1
        self.peak = max(self.peak, self.busy)

    def release(self) -> None:
        self.busy -= 1
        self._sem.release()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()


class ReadyBuffer(StagePool):
    """Prepared runtimes waiting for a run slot. A session takes a place when its INIT is done (waiting,
    with its INIT worker held, while the buffer is full: INIT stops making runtimes nobody can run yet) and
    gives it back once it holds a run slot."""

    def __init__(self, size: int) -> None:
        super().__init__("ready", size)
