"""Trainer callbacks: each finished session's result, and a task-done event, POSTed to the task's
`callback_url`, retried with exponential backoff.

Callbacks are queued in the store in the same transaction as the result they carry, so a restart resumes
delivery. Delivery runs in its own tasks: a callback URL that is down, slow or answers 500 costs its own
retries and nothing else; when the attempts run out the callback is recorded as `failed` with the last
error (visible in `GET /rollout/task/{id}`), and the result stays available by polling.

The URL is the task submitter's, so every connection goes through the server's `OutboundPolicy`
(`polar.netguard`), resolved again at delivery, and redirects are never followed. A refused destination
fails the callback at once (no retries: retrying would only probe it again) with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import aiohttp

from polar.netguard import OutboundPolicy, OutboundRefused, guarded_session
from polar.retry import backoff, delay_after
from polar.rollout.server.events import EventBus
from polar.rollout.server.store import CallbackRow, ServerStore

log = logging.getLogger("polar.server.callbacks")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8
    backoff_s: float = 0.5  # delay before the 2nd attempt; doubles each time
    backoff_max_s: float = 60.0
    timeout_s: float = 10.0

    def delay(self, attempts_made: int) -> float:
        """When the next attempt is due after `attempts_made` failed ones: the node's and clients' backoff
        (`polar.retry`), kept as a row's due time so that delivery resumes after a restart."""
        return delay_after(backoff(self.backoff_s, self.backoff_max_s), attempts_made)


class CallbackDeliverer:
    def __init__(
        self,
        store: ServerStore,
        events: EventBus,
        policy: RetryPolicy,
        concurrency: int = 16,
        outbound: OutboundPolicy | None = None,
    ) -> None:
        self.store = store
        self.events = events
        self.policy = policy
        self.outbound = outbound or OutboundPolicy()
        self._client: aiohttp.ClientSession | None = None  # opened on the loop, in start()
        self._sem = asyncio.Semaphore(concurrency)
        self._busy: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        # Delivery attempts since start, by outcome: delivered, retried, failed (given up) (metrics).
        self.attempts = {"delivered": 0, "retried": 0, "failed": 0}

    def start(self) -> None:
        self._client = guarded_session(
            self.outbound,
            connector={"limit": 0},  # the semaphore bounds concurrency
            timeout=aiohttp.ClientTimeout(total=self.policy.timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._loop = asyncio.create_task(self._run(), name="polar-callbacks")

    def wake(self) -> None:
        self._wake.set()

    async def aclose(self) -> None:
        for task in [self._loop, *self._tasks]:
            if task is not None:
                task.cancel()
        for task in [self._loop, *self._tasks]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._client is not None:
            await self._client.close()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            for cb in self.store.due_callbacks(64):
                if cb.id not in self._busy:
                    self._busy.add(cb.id)
                    task = asyncio.create_task(self._deliver(cb))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            nxt = self.store.next_callback_at()
            wait = 1.0 if nxt is None else min(1.0, max(0.01, nxt - time.time()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()

    async def _deliver(self, cb: CallbackRow) -> None:
        try:
            async with self._sem:
                error, refused = await self._post(cb)
            attempts = cb.attempts + 1
            if error is None:
                self.store.callback_attempt(cb.id, "delivered", None, time.time())
                self.attempts["delivered"] += 1
            elif refused or attempts >= self.policy.attempts:
                self.store.callback_attempt(cb.id, "failed", error, time.time())
                self.attempts["failed"] += 1
                log.warning("callback to %s gave up after %d attempts: %s", cb.url, attempts, error)
                self.events.publish(
                    "callback_failed", task_id=cb.task_id, session_id=cb.session_id, url=cb.url, error=error
                )
            else:
                self.store.callback_attempt(
                    cb.id, "pending", error, time.time() + self.policy.delay(attempts)
                )
                self.attempts["retried"] += 1
        finally:
            self._busy.discard(cb.id)
            self._wake.set()

    async def _post(self, cb: CallbackRow) -> tuple[str | None, bool]:
        """One attempt: (the error text, or None when the trainer acknowledged with a 2xx; whether the
        outbound policy refused the destination)."""
        if self._client is None:
            return "the callback deliverer is not started", False
        try:
            async with self._client.post(
                cb.url, data=cb.payload, headers={"content-type": "application/json"}, allow_redirects=False
            ) as r:
                if 200 <= r.status < 300:
                    return None, False
                body = await r.content.read(200)
                return f"HTTP {r.status}: {body.decode('utf-8', errors='replace')}", False
        except OutboundRefused as exc:
            return f"refused by the outbound policy: {exc}", True
        except (aiohttp.ClientError, TimeoutError) as exc:
            return (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__), False
