"""The rollout server's behaviour: tasks expand into sessions, sessions are placed on nodes, results are
recorded once, tasks finish (or stop early), trainers are called back. Routes (`app`) only translate HTTP.

One background loop (`_tick`, woken by any change and at least every `tick_s`) reconciles sessions bound
to nodes and places queued ones; dispatches, probes and node cancels run as their own tasks so a slow or
dead node never stalls the loop. All decisions are in `scheduler`; all state is in `store` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from polar.rollout.protocol import NodeStatus, SessionResult, SessionSpec, SessionStatus
from polar.rollout.server.callbacks import CallbackDeliverer, RetryPolicy
from polar.rollout.server.events import EventBus
from polar.rollout.server.nodelink import NodeLink
from polar.rollout.server.scheduler import (
    DispatchOutcome,
    NodeView,
    Probe,
    is_healthy,
    place,
    probe_decision,
)
from polar.rollout.server.store import ServerStore, SessionRow, TaskRow
from polar.rollout.task import Task

log = logging.getLogger("polar.server")


@dataclass(frozen=True)
class ServerConfig:
    db_path: Path = Path("polar-server.db")
    public_url: str | None = None  # how nodes reach this server (default: the URL a node registered to)
    heartbeat_timeout_s: float = 15.0  # no heartbeat for this long: unhealthy, gets no new sessions
    node_lost_after_s: float = 120.0  # no answer at all for this long: gone, its sessions end as ERROR
    node_timeout_s: float = 10.0  # per HTTP call to a node (dispatch, probe, cancel)
    probe_interval_s: float = 2.0  # how often one unsettled session is asked about
    audit_interval_s: float = 30.0  # how often a settled session on a healthy node is asked about
    refuse_cooldown_s: float = 1.0  # a node that refused a dispatch gets none for this long
    max_dispatch_attempts: int = 5  # a session refused this often ends as ERROR
    tick_s: float = 0.5
    callbacks: RetryPolicy = field(default_factory=RetryPolicy)
    max_body_bytes: int = 64 << 20


def new_session_id() -> str:
    """Single-use and unguessable: it doubles as the session's API key on the node's gateway."""
    return f"polar-{secrets.token_hex(12)}"


def _json(obj: Any) -> bytes:
    return orjson.dumps(obj)


class RolloutService:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = ServerStore(config.db_path)
        self.store.grace_nodes()
        self.store.unconfirm()  # results nodes could not deliver while we were down: ask for them
        self.events = EventBus()
        self.link = NodeLink(config.node_timeout_s)
        self.deliverer = CallbackDeliverer(self.store, self.events, config.callbacks)
        self._wake = asyncio.Event()
        self._results_changed = asyncio.Event()
        self._dispatching: set[str] = set()
        self._probing: set[str] = set()
        self._probed_at: dict[str, float] = {}  # session -> last probe (absent: never asked)
        self._tracked: dict[str, float] = {}  # session -> first seen on a node by this process
        self._stopping: set[str] = set()  # tasks whose open sessions are being ended by an early stop
        self._cooldown: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        self.deliverer.start()
        self._loop = asyncio.create_task(self._run(), name="polar-scheduler")
        active = self.store.active_task_ids()
        if active:
            log.info("resuming %d unfinished task(s)", len(active))
        for task_id in active:  # a task whose last session ended just before a crash
            self._after_session(task_id)

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

    def _spawn(self, coro: Any) -> None:
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
                self._tick()
            except Exception:
                log.exception("scheduler tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.tick_s)

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
        if open_ == 0 and self.store.finish_task(task_id, "DONE", reason):
            self._task_ended(task_id, "DONE", reason)

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
        payload = _json({"event": "session_result", "result": result.model_dump(mode="json")})
        seq = self.store.finish(result, task.task.callback_url, payload)
        if seq is None:
            return False
        self._probed_at.pop(result.session_id, None)
        self._tracked.pop(result.session_id, None)
        self.events.publish(
            "session_result",
            task_id=result.task_id,
            session_id=result.session_id,
            node_id=result.node_id,
            status=result.status.value,
            reward=result.reward,
            reason=result.reason,
        )
        self._notify_results()
        if task.task.callback_url:
            self.deliverer.wake()
        self._after_session(result.task_id)
        self.wake()
        return True

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
            self.store.set_stage(result.session_id, result.status)
            self.events.publish("session_stage", session_id=row.session_id, status=result.status.value)
            return "progress"
        task = self.store.task(row.task_id)
        assert task is not None
        return "recorded" if self._finish(task, result) else "duplicate"

    async def wait_results(self, task_ids: list[str], after: int, wait_s: float) -> list[tuple[int, bytes]]:
        """Results past `after`; when there are none yet, wait up to `wait_s` for one (long polling)."""
        deadline = time.monotonic() + wait_s
        while True:
            changed = self._results_changed
            rows = self.store.results(task_ids, after)
            left = deadline - time.monotonic()
            if rows or left <= 0 or self._all_ended(task_ids):
                return rows
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    def _all_ended(self, task_ids: list[str]) -> bool:
        rows = [self.store.task(t) for t in task_ids]
        return all(r is None or r.state != "ACTIVE" for r in rows)

    # -- nodes ------------------------------------------------------------------------------------------
    def register_node(self, node_id: str, url: str, capacity: int, server_url: str | None) -> None:
        known = self.store.node(node_id) is not None
        self.store.register_node(node_id, url.rstrip("/"), capacity, server_url)
        if known:  # the node restarted: whatever it ran for us is in its store, not its memory
            self.store.unconfirm(node_id)
        self._cooldown.pop(node_id, None)
        self.events.publish("node_registered", node_id=node_id, url=url, capacity=capacity)
        self.wake()

    def heartbeat(self, node_id: str, status: NodeStatus) -> bool:
        ok = self.store.heartbeat(node_id, status.model_dump(mode="json"), status.capacity, status.draining)
        if ok:
            self.wake()
        return ok

    def node_views(self, now: float | None = None) -> list[NodeView]:
        now = time.time() if now is None else now
        load = self.store.load_by_node()
        return [
            NodeView(
                node_id=n.node_id,
                url=n.url,
                capacity=n.capacity,
                load=load.get(n.node_id, 0),
                healthy=is_healthy(n.last_heartbeat, now, self.config.heartbeat_timeout_s)
                and self._cooldown.get(n.node_id, 0.0) <= now,
                draining=n.draining,
                lost=n.lost,
            )
            for n in self.store.nodes()
        ]

    # -- the loop ---------------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.time()
        views = self.node_views(now)
        by_id = {v.node_id: v for v in views}
        contact = {n.node_id: n.last_contact for n in self.store.nodes()}
        for s in self.store.on_nodes():
            assert s.node_id is not None
            decision = probe_decision(
                confirmed=s.confirmed,
                dispatch_in_flight=s.session_id in self._dispatching,
                node=by_id.get(s.node_id),
                last_contact=contact.get(s.node_id, 0.0),
                now=now,
                node_lost_after_s=self.config.node_lost_after_s,
                last_probe=self._probed_at.get(s.session_id) or self._tracked.setdefault(s.session_id, now),
                audit_interval_s=self.config.audit_interval_s,
            )
            if decision is Probe.LOST:
                self._node_lost(s)
            elif (
                decision is Probe.ASK
                and s.session_id not in self._probing
                and now - self._probed_at.get(s.session_id, 0.0) >= self.config.probe_interval_s
            ):
                self._probing.add(s.session_id)
                self._spawn(self._probe(s, by_id[s.node_id]))
        free = sum(max(0, v.capacity - v.load) for v in views if v.admits)
        if free == 0:
            return
        queue = {s.session_id: s for s in self.store.queued(free)}
        for session_id, node_id in place(list(queue), views):
            s = queue[session_id]
            if s.attempts >= self.config.max_dispatch_attempts:
                self._fail(s, f"not accepted by any node after {s.attempts} dispatch attempts")
            elif self.store.claim(session_id, node_id):
                self._dispatching.add(session_id)
                self._spawn(self._dispatch(s, by_id[node_id]))

    def _fail(self, s: SessionRow, reason: str) -> None:
        task = self.store.task(s.task_id)
        assert task is not None
        self._finish(task, self._synthetic(task, s, SessionStatus.ERROR, reason))

    def _node_lost(self, s: SessionRow) -> None:
        assert s.node_id is not None
        node = self.store.node(s.node_id)
        if node is not None and not node.lost:
            self.store.mark_lost(s.node_id)
            log.warning("node %s is gone: no answer for %.0fs", s.node_id, time.time() - node.last_contact)
            self.events.publish("node_lost", node_id=s.node_id)
        self._fail(s, f"node lost: {s.node_id} stopped answering; not re-run (it may have run there)")

    async def _dispatch(self, s: SessionRow, node: NodeView) -> None:
        try:
            task = self.store.task(s.task_id)
            assert task is not None
            reg = self.store.node(node.node_id)
            server_url = self.config.public_url or (reg.server_url if reg else None)
            group = task.task.metadata.get("group_id")
            spec = SessionSpec(
                session_id=s.session_id,
                task=task.task,
                sample_index=s.sample_index,
                group_id=group if isinstance(group, str) else None,
                server_url=server_url,
            )
            outcome, error = await self.link.dispatch(node.url, spec)
            if outcome is DispatchOutcome.ACCEPTED:
                self.store.confirm(s.session_id, node.node_id)
                self.store.touch_node(node.node_id)
                self.events.publish("session_dispatched", session_id=s.session_id, node_id=node.node_id)
                now = self.store.session(s.session_id)
                if now is not None and now.status.terminal:  # cancelled while the dispatch was in flight
                    await self._cancel_on_node(node.node_id, s.session_id)
            elif outcome is DispatchOutcome.REFUSED:
                self.store.release(s.session_id, node.node_id)
                self._cooldown[node.node_id] = time.time() + self.config.refuse_cooldown_s
                log.info("node %s refused %s: %s", node.node_id, s.session_id, error)
            elif outcome is DispatchOutcome.REJECTED:
                self.store.touch_node(node.node_id)
                self._fail(s, f"node {node.node_id} rejected the session: {error}")
            else:
                log.warning(
                    "dispatch of %s to %s unsettled (%s); asking the node", s.session_id, node.node_id, error
                )
        finally:
            self._dispatching.discard(s.session_id)
            self.wake()

    async def _probe(self, s: SessionRow, node: NodeView) -> None:
        try:
            answer = await self.link.probe(node.url, s.session_id)
            self._probed_at[s.session_id] = time.time()
            if not answer.reachable:
                return  # the loss clock (last_contact) decides when to give up
            self.store.touch_node(node.node_id)
            if s.session_id in self._dispatching:
                return
            if answer.state is None:
                self._tracked.pop(s.session_id, None)
                self.store.release(s.session_id, node.node_id)
                self.events.publish("session_requeued", session_id=s.session_id, node_id=node.node_id)
                return
            self.store.confirm(s.session_id, node.node_id)
            state = answer.state
            if state.status.terminal:
                if state.result is not None:
                    # The node may not know the task (it restarted and reports the session lost).
                    update = {"task_id": s.task_id, "node_id": state.result.node_id or node.node_id}
                    self.record(state.result.model_copy(update=update))
                else:
                    reason = f"node {node.node_id} reports {state.status.value} but kept no result"
                    self._fail(s, reason)
            elif state.status not in (SessionStatus.REGISTERED, SessionStatus.DISPATCHED):
                self.store.set_stage(s.session_id, state.status)
        finally:
            self._probing.discard(s.session_id)
            self.wake()
