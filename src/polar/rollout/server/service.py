"""The rollout server's behaviour: tasks expand into sessions, sessions are placed on nodes, results are
recorded once, tasks finish (or stop early), trainers are called back. Routes (`app`) only translate HTTP.

One background loop (woken by any change and at least every `tick_s`) runs `Dispatcher.tick`, which
settles sessions bound to nodes and places queued ones. All decisions are in `scheduler`; all state is in
`store` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import Any

import orjson

from polar.jsontypes import JSON
from polar.rollout.protocol import DrainRequest, HeartbeatReply, NodeStatus, SessionResult, SessionStatus
from polar.rollout.server import grouping
from polar.rollout.server.callbacks import CallbackDeliverer
from polar.rollout.server.config import ServerConfig
from polar.rollout.server.dispatch import Dispatcher
from polar.rollout.server.events import EventBus
from polar.rollout.server.nodelink import NodeLink
from polar.rollout.server.scheduler import NodeView
from polar.rollout.server.security import SecurityLog
from polar.rollout.server.store import ServerStore, SessionRow, TaskRow
from polar.task import Task

log = logging.getLogger("polar.server")


def new_session_id() -> str:
    """Single-use and unguessable: it doubles as the session's API key on the node's gateway."""
    return f"polar-{secrets.token_hex(12)}"


def _json(obj: JSON) -> bytes:
    return orjson.dumps(obj)


class RolloutService:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = ServerStore(config.db_path)
        self.store.grace_nodes()
        self.store.unconfirm()  # results nodes could not deliver while we were down: ask for them
        self.events = EventBus()
        self.link = NodeLink(config.node_timeout_s, config.token)
        self.deliverer = CallbackDeliverer(
            self.store, self.events, config.callbacks, outbound=config.outbound
        )
        self.dispatcher = Dispatcher(
            self.store,
            self.link,
            self.events,
            config,
            fail=self._fail,
            record=self.record,
            cancel_on_node=self._cancel_on_node,
            spawn=self._spawn,
            wake=self.wake,
        )
        self._wake = asyncio.Event()
        self._results_changed = asyncio.Event()
        self._stopping: set[str] = set()  # tasks whose open sessions are being ended by an early stop
        self._judging: set[str] = set()  # tasks in their group phase (`grouping`)
        self.security = SecurityLog()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        self.deliverer.start()
        self._loop = asyncio.create_task(self._run(), name="polar-scheduler")
        active = self.store.active_task_ids()
        if active:
            log.info("resuming %d unfinished task(s)", len(active))
        for task_id in active:  # a task whose last session ended just before a crash, or mid-phase
            self._after_session(task_id)
        for task_id in set(self.store.held_task_ids()) - set(active):  # cancelled as the server stopped
            self._release_unjudged(task_id, "the task ended before its group was judged")

    async def aclose(self) -> None:
        pending = [t for t in (self._loop, *self._tasks) if t is not None]
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.deliverer.aclose()
        await self.link.aclose()
        self.store.close()

    def wake(self) -> None:
        self._wake.set()

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background %s failed", task.get_coro(), exc_info=task.exception())

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                self.dispatcher.tick()
            except Exception:
                log.exception("scheduler tick failed")
            # asyncio.timeout, not wait_for: on Python 3.11 a cancel arriving as the wait is woken was
            # swallowed and `aclose` waited forever (tests/test_server_cancel.py).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.tick_s):
                    await self._wake.wait()

    # -- tasks ------------------------------------------------------------------------------------------
    def submit(self, tasks: list[Task]) -> list[dict[str, Any]]:
        """Store the tasks and their sessions (all or none); KeyError names a task id already submitted."""
        planned = [(t, [new_session_id() for _ in range(t.num_samples)]) for t in tasks]
        self.store.add_tasks(planned)
        for task, sids in planned:
            self.events.publish("task_submitted", task_id=task.task_id, num_samples=len(sids))
        self.wake()
        return [{"task_id": t.task_id, "session_ids": sids} for t, sids in planned]

    def cancel(self, task_id: str, reason: str = "cancelled by request") -> bool:
        """Cancel an active task: queued sessions end now, running ones are cancelled on their nodes.
        KeyError if unknown; False if the task had already ended."""
        if self.store.task(task_id) is None:
            raise KeyError(task_id)
        if not self.store.finish_task(task_id, "CANCELLED", reason):
            return False
        self._end_open(task_id, SessionStatus.CANCELLED, reason)
        self._release_unjudged(task_id, f"cancelled before its group was judged: {reason}")
        self._task_ended(task_id, "CANCELLED", reason)
        return True

    def _end_open(self, task_id: str, status: SessionStatus, reason: str) -> None:
        task = self.store.task(task_id)
        assert task is not None
        for s in self.store.sessions_of(task_id):
            if s.status.terminal:
                continue
            if self._finish(task, self._synthetic(task, s, status, reason)) and s.node_id is not None:
                self._spawn(self._cancel_on_node(s.node_id, s.session_id))

    async def _cancel_on_node(self, node_id: str, session_id: str) -> None:
        node = self.store.node(node_id)
        if node is None:
            return
        error = await self.link.cancel(node.url, session_id)
        if error is not None:
            log.warning("could not cancel %s on node %s: %s", session_id, node_id, error)

    def _task_ended(self, task_id: str, state: str, reason: str | None) -> None:
        task = self.store.task(task_id)
        assert task is not None
        counts = self.store.counts(task_id)
        event = {"event": "task_done", "task_id": task_id, "state": state, "reason": reason, "counts": counts}
        if task.task.callback_url:
            self.store.queue_callback(task_id, None, task.task.callback_url, _json(event))
            self.deliverer.wake()
        self.events.publish("task_done", task_id=task_id, state=state, reason=reason, counts=counts)
        self._notify_results()

    def _notify_results(self) -> None:
        """Wake every long poll waiting on the current event, and give later waiters a fresh one."""
        self._results_changed.set()
        self._results_changed = asyncio.Event()

    def _after_session(self, task_id: str) -> None:
        """Early stop and task completion, after one of the task's sessions ended."""
        if task_id in self._stopping:
            return  # the early stop below is ending this task's sessions; it finishes the task itself
        task = self.store.task(task_id)
        if task is None or task.state != "ACTIVE":
            return
        counts = self.store.counts(task_id)
        open_ = sum(n for s, n in counts.items() if not SessionStatus(s).terminal)
        need = task.task.early_stop_min_usable
        reason = None
        if need is not None and counts.get(SessionStatus.COMPLETED, 0) >= need:
            reason = f"early stop: {need} usable sessions done"
            if open_:
                self._stopping.add(task_id)
                try:
                    self._end_open(task_id, SessionStatus.CANCELLED, reason)
                finally:
                    self._stopping.discard(task_id)
                open_ = 0
        if open_ == 0 and self.store.holds(task_id):
            if task_id not in self._judging:
                self._judging.add(task_id)
                self._spawn(self._group_phase(task_id, reason))
        elif open_ == 0 and self.store.finish_task(task_id, "DONE", reason):
            self._task_ended(task_id, "DONE", reason)

    async def _group_phase(self, task_id: str, reason: str | None) -> None:
        """Judge the task's group, release its held results, finish the task (`grouping`)."""
        try:
            task = self.store.task(task_id)
            assert task is not None
            held = self.store.held(task_id)
            self.events.publish("group_judging", task_id=task_id, sessions=len(grouping.outcomes(held)))
            try:
                answer = await grouping.judge(self.link, self.store.nodes, task.task, held)
            except Exception as exc:  # a bug here must not hold the group forever: release it masked
                log.exception("group phase of task %s failed", task_id)
                answer = grouping.GroupAnswer(failed=f"judge_group: group phase failed: {exc}")
            self._release(task, [grouping.settled(r, answer) for r in held])
            if self.store.finish_task(task_id, "DONE", reason):
                self._task_ended(task_id, "DONE", reason)
        finally:
            self._judging.discard(task_id)

    def groups_view(self) -> dict[str, Any]:
        """`judge_group` tasks at a glance: results kept back for their group, and the tasks whose group
        is being judged now with how many sessions each."""
        held = self.store.held_counts()
        return {
            "held_sessions": sum(held.values()),
            "judging": {task_id: held.get(task_id, 0) for task_id in sorted(self._judging)},
        }

    def _release_unjudged(self, task_id: str, why: str) -> None:
        """Release what a task holds without judging it (the task ended another way): masked."""
        task = self.store.task(task_id)
        if task is not None and self.store.holds(task_id):
            failed = grouping.GroupAnswer(failed=why)
            self._release(task, [grouping.settled(r, failed) for r in self.store.held(task_id)])

    def _release(self, task: TaskRow, results: list[SessionResult]) -> None:
        payloads = [_json({"event": "session_result", "result": r.model_dump(mode="json")}) for r in results]
        released = set(self.store.release_held(results, task.task.callback_url, payloads))
        for r in results:
            if r.session_id in released:
                self._published(r)
        self._notify_results()
        if task.task.callback_url:
            self.deliverer.wake()

    def _published(self, result: SessionResult) -> None:
        self.events.publish(
            "session_result",
            task_id=result.task_id,
            session_id=result.session_id,
            node_id=result.node_id,
            status=result.status.value,
            reward=result.reward,
            reason=result.reason,
        )

    # -- results ----------------------------------------------------------------------------------------
    @staticmethod
    def _metadata(task: Task, sample_index: int) -> dict[str, Any]:
        return {
            **task.metadata,
            "sample_index": sample_index,
            "group_id": task.metadata.get("group_id", task.task_id),
        }

    def _synthetic(self, task: TaskRow, s: SessionRow, status: SessionStatus, reason: str) -> SessionResult:
        """A result the server decides (cancelled, node lost, rejected): no trajectory, no reward."""
        return SessionResult(
            session_id=s.session_id,
            task_id=s.task_id,
            node_id=s.node_id,
            status=status,
            reason=reason,
            metadata=self._metadata(task.task, s.sample_index),
        )

    def _finish(self, task: TaskRow, result: SessionResult) -> bool:
        """Record a terminal result and release it, or hold it while its task's group is to be judged."""
        payload = _json({"event": "session_result", "result": result.model_dump(mode="json")})
        hold = task.state == "ACTIVE" and grouping.relative(task.task)
        seq = self.store.finish(result, task.task.callback_url, payload, hold=hold)
        if seq is None:
            return False
        self.dispatcher.forget(result.session_id)
        if hold:
            self.events.publish(
                "session_held",
                task_id=result.task_id,
                session_id=result.session_id,
                status=result.status.value,
            )
        else:
            self._published(result)
            self._notify_results()
        if task.task.callback_url:
            self.deliverer.wake()
        self._after_session(result.task_id)
        self.wake()
        return True

    def report(self, result: SessionResult, result_token: str | None, client: str) -> str:
        """A node's report over HTTP: `record` once its dispatch credential checks out, else 'refused'
        (not from the node the session was dispatched to: counted, logged, published)."""
        row = self.store.session(result.session_id)
        if row is None:
            return "unknown"
        if not self.store.reported_by_dispatch(result.session_id, result.node_id, result_token):
            why = "no result token" if result_token is None else "wrong result token or node"
            self.security.refused_result(result.session_id, result.node_id, client, why)
            self.events.publish(
                "result_refused", session_id=result.session_id, node_id=result.node_id, client=client, why=why
            )
            log.warning(
                "refused a result for %s from %s (node %s): %s",
                result.session_id,
                client,
                result.node_id,
                why,
            )
            return "refused"
        return self.record(result)

    def record(self, result: SessionResult) -> str:
        """A node's report: 'recorded', 'progress', 'duplicate' (already terminal: first result wins),
        'unknown' (no such session) or 'mismatch' (the session belongs to another task)."""
        row = self.store.session(result.session_id)
        if row is None:
            return "unknown"
        if row.task_id != result.task_id:
            return "mismatch"
        if not result.status.terminal:
            if row.status.terminal:
                return "duplicate"
            if result.status is SessionStatus.REGISTERED:
                return self._handed_back(row, result)
            self.store.set_stage(result.session_id, result.status)
            self.events.publish("session_stage", session_id=row.session_id, status=result.status.value)
            return "progress"
        task = self.store.task(row.task_id)
        assert task is not None
        return "recorded" if self._finish(task, result) else "duplicate"

    async def wait_results(
        self, task_ids: list[str], after: int, wait_s: float, limit: int = 64
    ) -> list[tuple[int, bytes]]:
        """Results past `after`; when there are none yet, wait up to `wait_s` for one (long polling)."""
        deadline = time.monotonic() + wait_s
        while True:
            changed = self._results_changed
            rows = self.store.results(task_ids, after, limit)
            left = deadline - time.monotonic()
            if rows or left <= 0 or self._all_ended(task_ids):
                return rows
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await changed.wait()

    def _all_ended(self, task_ids: list[str]) -> bool:
        rows = [self.store.task(t) for t in task_ids]
        return all(r is None or r.state != "ACTIVE" for r in rows)

    # -- nodes ------------------------------------------------------------------------------------------
    def register_node(self, node_id: str, url: str, capacity: int, server_url: str | None) -> None:
        known = self.store.node(node_id) is not None
        self.store.register_node(node_id, url.rstrip("/"), capacity, server_url)
        if known:  # the node restarted: whatever it ran for us is in its store, not its memory
            self.store.unconfirm(node_id)
        self.dispatcher.node_registered(node_id)
        self.events.publish("node_registered", node_id=node_id, url=url, capacity=capacity)
        self.wake()

    def heartbeat(self, node_id: str, status: NodeStatus) -> HeartbeatReply | None:
        """None: no such node (it must register). The image list is kept in memory, not in each row."""
        stored = status.model_dump(mode="json", exclude={"images"})
        if not self.store.heartbeat(node_id, stored, status.capacity, status.draining):
            return None
        reply = self.dispatcher.heartbeat(node_id, status)
        self.wake()
        return reply

    def node_views(self, now: float | None = None) -> list[NodeView]:
        return self.dispatcher.node_views(now)

    def _handed_back(self, row: SessionRow, result: SessionResult) -> str:
        """A draining node gave the session back before its agent started: queued again, same id (it never
        ran), and the dispatch does not count as an attempt."""
        node_id = result.node_id or row.node_id
        if node_id is None or not self.store.release(row.session_id, node_id, refund=True):
            return "duplicate"  # already released (a probe's 404 came first) or ended
        self.dispatcher.forget(row.session_id)
        log.info("node %s handed back %s: %s", node_id, row.session_id, result.reason)
        self.events.publish(
            "session_requeued", session_id=row.session_id, node_id=node_id, reason=result.reason
        )
        self.wake()
        return "requeued"

    async def drain_node(self, node_id: str, request: DrainRequest) -> NodeStatus:
        """Stop placing sessions on the node now and ask it to drain (KeyError: no such node; RuntimeError:
        the node did not answer, and is placed on again once it heartbeats as not draining)."""
        node = self.store.node(node_id)
        if node is None:
            raise KeyError(node_id)
        self.store.set_draining(node_id)
        status, error = await self.link.drain(node.url, request)
        if status is None:
            raise RuntimeError(f"node {node_id} at {node.url} did not take the drain: {error}")
        self.events.publish("node_draining", node_id=node_id, reason=request.reason)
        return status

    def leave_node(self, node_id: str) -> int | None:
        """A drained node leaving: the count of sessions still open on it (0: it is forgotten), None if
        unknown."""
        open_ = self.store.remove_node(node_id)
        if open_ == 0:
            self.dispatcher.node_registered(node_id)  # drop its cooldown
            self.events.publish("node_left", node_id=node_id)
            log.info("node %s left", node_id)
        return open_

    def node_gone(self, node_id: str, reason: str) -> int | None:
        """An operator or a cluster manager (Ray, `polar.rollout.ray`) knows the node is dead: mark it lost
        now instead of after `node_lost_after_s` of silence, and end its open sessions ERROR naming
        `reason`. They are not re-run: the node may have run them. A node that heartbeats again is
        placed on again. The count of sessions ended, None if the node is unknown."""
        if self.store.node(node_id) is None:
            return None
        self.store.mark_lost(node_id)
        log.warning("node %s is gone: %s", node_id, reason)
        self.events.publish("node_lost", node_id=node_id, reason=reason)
        ended = 0
        for s in self.store.on_nodes():
            if s.node_id == node_id:
                self._fail(s, f"node lost: {node_id}: {reason}; not re-run (it may have run there)")
                ended += 1
        self.wake()
        return ended

    def _fail(self, s: SessionRow, reason: str) -> None:
        """End a session as ERROR with `reason`, decided by the server (no trajectory, no reward)."""
        task = self.store.task(s.task_id)
        assert task is not None
        self._finish(task, self._synthetic(task, s, SessionStatus.ERROR, reason))
