"""Placing sessions on nodes and settling what the server does not know: the I/O side of `scheduler`.

`tick()` (called by the service's loop) probes sessions whose node is silent or whose dispatch answer was
lost, ends sessions of nodes gone for good, and dispatches queued sessions to the nodes `place` picks.
Dispatches and probes run as their own tasks, so a slow or dead node never stalls the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from polar.rollout.protocol import SessionResult, SessionSpec, SessionStatus
from polar.rollout.server.config import ServerConfig
from polar.rollout.server.events import EventBus
from polar.rollout.server.nodelink import NodeLink, outcome_is_auth
from polar.rollout.server.scheduler import (
    DispatchOutcome,
    NodeView,
    Probe,
    is_healthy,
    place,
    probe_decision,
)
from polar.rollout.server.store import ServerStore, SessionRow

log = logging.getLogger("polar.server")


class Dispatcher:
    def __init__(
        self,
        store: ServerStore,
        link: NodeLink,
        events: EventBus,
        config: ServerConfig,
        *,
        fail: Callable[[SessionRow, str], None],
        record: Callable[[SessionResult], str],
        cancel_on_node: Callable[[str, str], Coroutine[Any, Any, None]],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        wake: Callable[[], None],
    ) -> None:
        self.store, self.link, self.events, self.config = store, link, events, config
        self.fail, self.record, self.cancel_on_node, self.spawn, self.wake = (
            fail,
            record,
            cancel_on_node,
            spawn,
            wake,
        )
        self._dispatching: set[str] = set()
        self._probing: set[str] = set()
        self._probed_at: dict[str, float] = {}  # session -> last probe (absent: never asked)
        self._tracked: dict[str, float] = {}  # session -> first seen on a node by this process
        self._cooldown: dict[str, float] = {}  # node -> no dispatches before this time (it refused one)
        self.auth_errors: dict[str, str] = {}  # node -> why it refused our token (shown in /nodes)

    def forget(self, session_id: str) -> None:
        """The session ended: drop its clocks."""
        self._probed_at.pop(session_id, None)
        self._tracked.pop(session_id, None)

    def node_registered(self, node_id: str) -> None:
        self._cooldown.pop(node_id, None)

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
    def tick(self) -> None:
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
                self.spawn(self._probe(s, by_id[s.node_id]))
        free = sum(max(0, v.capacity - v.load) for v in views if v.admits)
        if free == 0:
            return
        queue = {s.session_id: s for s in self.store.queued(free)}
        for session_id, node_id in place(list(queue), views):
            s = queue[session_id]
            if s.attempts >= self.config.max_dispatch_attempts:
                self.fail(s, f"not accepted by any node after {s.attempts} dispatch attempts")
            elif (token := self.store.claim(session_id, node_id)) is not None:
                self._dispatching.add(session_id)
                self.spawn(self._dispatch(s, by_id[node_id], token))

    def _node_lost(self, s: SessionRow) -> None:
        assert s.node_id is not None
        node = self.store.node(s.node_id)
        if node is not None and not node.lost:
            self.store.mark_lost(s.node_id)
            log.warning("node %s is gone: no answer for %.0fs", s.node_id, time.time() - node.last_contact)
            self.events.publish("node_lost", node_id=s.node_id)
        self.fail(s, f"node lost: {s.node_id} stopped answering; not re-run (it may have run there)")

    async def _dispatch(self, s: SessionRow, node: NodeView, result_token: str) -> None:
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
                result_token=result_token,
            )
            outcome, error = await self.link.dispatch(node.url, spec)
            if outcome is DispatchOutcome.UNKNOWN:
                # The answer was lost. Resending the same dispatch is safe (a node answers a dispatch it
                # already accepted with "duplicate", and one it refused stays refused) and usually settles
                # it at once; the node is cooled down so that, if it stays unsettled, the session requeued
                # after the probe goes elsewhere.
                self._cooldown[node.node_id] = time.time() + self.config.refuse_cooldown_s
                log.info(
                    "dispatch of %s to %s unsettled (%s); sending it again", s.session_id, node.node_id, error
                )
                outcome, error = await self.link.dispatch(node.url, spec)
            if outcome is DispatchOutcome.ACCEPTED:
                self._cooldown.pop(node.node_id, None)
                self.auth_errors.pop(node.node_id, None)
                self.store.confirm(s.session_id, node.node_id)
                self.store.touch_node(node.node_id)
                self.events.publish("session_dispatched", session_id=s.session_id, node_id=node.node_id)
                now = self.store.session(s.session_id)
                if now is not None and now.status.terminal:  # cancelled while the dispatch was in flight
                    await self.cancel_on_node(node.node_id, s.session_id)
            elif outcome is DispatchOutcome.REFUSED:
                self.store.release(s.session_id, node.node_id)
                self._cooldown[node.node_id] = time.time() + self.config.refuse_cooldown_s
                if outcome_is_auth(error):
                    self.auth_errors[node.node_id] = str(error)
                    log.error("node %s refused the server's control token: %s", node.node_id, error)
                else:
                    log.info("node %s refused %s: %s", node.node_id, s.session_id, error)
            elif outcome is DispatchOutcome.REJECTED:
                self.store.touch_node(node.node_id)
                self.fail(s, f"node {node.node_id} rejected the session: {error}")
            else:
                log.warning(
                    "dispatch of %s to %s unsettled (%s); asking the node", s.session_id, node.node_id, error
                )
        finally:
            self._dispatching.discard(s.session_id)
            self.wake()

    async def _probe(self, s: SessionRow, node: NodeView) -> None:
        try:
            # Unconfirmed: a dispatch whose answer was lost. The probe names it, so a 404 is final (fenced).
            token = None if s.confirmed else self.store.dispatch_token(s.session_id)
            answer = await self.link.probe(node.url, node.node_id, s.session_id, token)
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
                    self.fail(s, reason)
            elif state.status not in (SessionStatus.REGISTERED, SessionStatus.DISPATCHED):
                self.store.set_stage(s.session_id, state.status)
        finally:
            self._probing.discard(s.session_id)
            self.wake()
