"""The node's container images: what its engines hold, told to the server, and pulls the server asks for.

The rollout server places a session where its image already is, and asks nodes to fetch the images of
queued sessions while their pools run (`polar.rollout.server.scheduler`). For that a node lists its
engines' images (`docker image ls`: tens of milliseconds, so every `refresh_s` and after each pull, off the
event loop) and reports them in its heartbeat, the whole list only when the server's copy differs.

A pull is the engine's own `pull` of a reference a task named: it runs no code of the task's (a node never
builds a submitted task's image: a Dockerfile's RUN would be code named by a request). One pull at a time,
so fetches do not starve running sessions of disk and network; a failed pull (no registry answers, no such
image) is not tried again for `retry_after_s`, and the reason is logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
import time
from collections.abc import Iterable

from polar.rollout.protocol import ImageRef
from polar.runtime.base import RuntimeFailure
from polar.runtime.images import ENGINES
from polar.runtime.inventory import list_images, normalize_ref, pull_image

log = logging.getLogger("polar.node")


def node_engines(allowed_runtimes: Iterable[str] | None) -> tuple[str, ...]:
    """The container engines this node may run sessions in and has installed."""
    allowed = set(ENGINES if allowed_runtimes is None else allowed_runtimes)
    return tuple(e for e in ENGINES if e in allowed and shutil.which(e) is not None)


class ImageInventory:
    def __init__(
        self,
        engines: Iterable[str],
        *,
        refresh_s: float = 30.0,
        retry_after_s: float = 600.0,
        pull_timeout_s: float = 3600.0,
    ) -> None:
        self.engines = tuple(engines)
        self.refresh_s, self.retry_after_s, self.pull_timeout_s = refresh_s, retry_after_s, pull_timeout_s
        self.held: dict[str, frozenset[str]] = {}  # engine -> references (engines that answered)
        self.digest: str | None = None
        self.fetching: dict[str, set[str]] = {e: set() for e in self.engines}
        self.failed: dict[tuple[str, str], float] = {}  # (engine, ref) -> when its pull failed
        self.pulled = 0  # pulls that succeeded (metrics)
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._quiet: set[str] = set()  # engines whose listing failure was logged

    # -- what the heartbeat carries -------------------------------------------------------------------
    def report(self, server_digest: str | None) -> dict[str, object]:
        """The NodeStatus fields: the list itself only when the server holds another digest."""
        fields: dict[str, object] = {
            "engines": sorted(self.held),
            "images_digest": self.digest,
            "fetching": {e: sorted(refs) for e, refs in self.fetching.items() if refs},
        }
        if self.digest is not None and server_digest != self.digest:
            fields["images"] = {e: sorted(refs) for e, refs in self.held.items()}
        return fields

    def want(self, refs: Iterable[ImageRef]) -> None:
        """Queue pulls of images the server asked for that this node lacks, is not pulling, and did not
        fail to pull lately."""
        now = time.monotonic()
        for ref in refs:
            engine, image = ref.engine, normalize_ref(ref.image)
            if engine not in self.held or image in self.held[engine] or image in self.fetching[engine]:
                continue
            if now - self.failed.get((engine, image), -self.retry_after_s) < self.retry_after_s:
                continue
            self.fetching[engine].add(image)
            self._queue.put_nowait((engine, image))

    # -- the work ---------------------------------------------------------------------------------------
    async def refresh(self) -> None:
        held = {}
        for engine in self.engines:
            try:
                held[engine] = await asyncio.to_thread(list_images, engine)
                self._quiet.discard(engine)
            except RuntimeFailure as exc:
                if engine not in self._quiet:
                    log.warning("cannot list %s images (placement will not count on them): %s", engine, exc)
                    self._quiet.add(engine)
        self.held = held
        if not held:
            self.digest = None
            return
        h = hashlib.sha256()
        for engine in sorted(held):
            h.update(engine.encode() + b"\0" + "\n".join(sorted(held[engine])).encode() + b"\0")
        self.digest = h.hexdigest()[:32]

    async def start(self) -> None:
        if not self.engines:
            return
        await self.refresh()
        self._tasks = [asyncio.create_task(self._refreshing()), asyncio.create_task(self._pulling())]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _refreshing(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def _pulling(self) -> None:
        while True:
            engine, image = await self._queue.get()
            started = time.monotonic()
            failed = False
            try:
                await asyncio.to_thread(pull_image, engine, image, self.pull_timeout_s)
            except RuntimeFailure as exc:
                failed = True
                log.warning("prefetch of %s image %s failed: %s", engine, image, exc)
            else:
                self.pulled += 1
                log.info("prefetched %s image %s in %.1fs", engine, image, time.monotonic() - started)
            await self.refresh()
            self.fetching[engine].discard(image)  # after the refresh: held or fetching, never neither
            if failed:
                self.failed[(engine, image)] = time.monotonic()
