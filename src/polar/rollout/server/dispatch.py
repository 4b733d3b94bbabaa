"""Placing sessions on nodes and settling what the server does not know: the I/O side of `scheduler`.

`tick()` (called by the service's loop) probes sessions whose node is silent or whose dispatch answer was
lost, ends sessions of nodes gone for good, and dispatches queued sessions to the nodes `place` picks.
Dispatches and probes run as their own tasks, so a slow or dead node never stalls the loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from polar.jsontypes import JSON, JSONObject
from polar.rollout.protocol import (
    HeartbeatReply,
    ImageRef,
    NodeStatus,
    SessionResult,
    SessionSpec,
    SessionStatus,
)
from polar.rollout.server.config import ServerConfig
from polar.rollout.server.events import EventBus
from polar.rollout.server.nodelink import NodeLink, outcome_is_auth
from polar.rollout.server.scheduler import (
    DispatchOutcome,
    Image,
    Need,
    NodeView,
    Probe,
    is_healthy,
    place,
    prefetch,
    probe_decision,
    with_arrivals,
)
from polar.rollout.server.store import NodeRow, ServerStore, SessionRow
from polar.runtime.images import ENGINES
from polar.runtime.inventory import normalize_ref

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
        self._images: dict[str, tuple[str, frozenset[Image]]] = {}  # node -> (digest, images it reported)
        self._needs: dict[str, Need] = {}  # task -> what placement knows of its sessions (tasks never change)
        self.prefetching: dict[str, list[Image]] = {}  # node -> images the last tick asked it to fetch
        self._passed_over: dict[str, float] = {}  # session -> first passed over for a slot by its image

    def forget(self, session_id: str) -> None:
        """The session ended: drop its clocks."""
        self._probed_at.pop(session_id, None)
        self._tracked.pop(session_id, None)
        self._passed_over.pop(session_id, None)

    def node_registered(self, node_id: str) -> None:
        self._cooldown.pop(node_id, None)

    def heartbeat(self, node_id: str, status: NodeStatus) -> HeartbeatReply:
        """Keep the image list a heartbeat carried; answer with the digest held and the images to fetch."""
        if status.images is not None and status.images_digest is not None:
            held = frozenset((e, normalize_ref(r)) for e, refs in status.images.items() for r in refs)
            self._images[node_id] = (status.images_digest, held)
        elif status.images_digest is None:
            self._images.pop(node_id, None)
        digest = self._images.get(node_id, (None, frozenset()))[0]
        asked = [ImageRef(engine=e, image=r) for e, r in self.prefetching.get(node_id, [])]
        return HeartbeatReply(images_digest=digest, prefetch=asked)

    def where(self, images: list[ImageRef]) -> JSONObject:
        """For each image: the live nodes holding it and those fetching it; and per engine the live nodes
        that report images at all (an image on none of those is on no node anyone can tell of)."""
        live = [v for v in self.node_views() if v.healthy and not v.draining and not v.lost]
        reporting: dict[str, list[str]] = {}
        for v in live:
            for engine in sorted(v.engines):
                reporting.setdefault(engine, []).append(v.node_id)
        out: list[JSON] = []
        for ref in images:
            key = (ref.engine, normalize_ref(ref.image))
            held = [v.node_id for v in live if key in v.images]
            fetching = [v.node_id for v in live if key in v.fetching]
            out.append({"engine": ref.engine, "image": ref.image, "held_by": held, "fetching_on": fetching})
        return {"images": out, "reporting": dict(reporting), "nodes": len(live)}

    def node_views(self, now: float | None = None) -> list[NodeView]:
        now = time.time() if now is None else now
        load = self.store.load_by_node()
        return [self._view(n, load.get(n.node_id, 0), now) for n in self.store.nodes()]

    def _view(self, n: NodeRow, load: int, now: float) -> NodeView:
        status = n.status or {}
        fetching = status.get("fetching") or {}
        return NodeView(
            node_id=n.node_id,
            url=n.url,
            capacity=n.capacity,
            load=load,
            healthy=is_healthy(n.last_heartbeat, now, self.config.heartbeat_timeout_s)
            and self._cooldown.get(n.node_id, 0.0) <= now,
            draining=n.draining,
            lost=n.lost,
            images=self._images.get(n.node_id, ("", frozenset()))[1],
            fetching=frozenset((e, normalize_ref(r)) for e, refs in fetching.items() for r in refs),
            engines=frozenset(status.get("engines") or ()),
        )

    def _need(self, s: SessionRow) -> Need:
        need = self._needs.get(s.task_id)
        if need is None:
            row = self.store.task(s.task_id)
            task = row.task if row is not None else None
            image: Image | None = None
            group = s.task_id
            if task is not None:
                rt = task.runtime
                if rt.backend in ENGINES and rt.image is not None:
                    image = (rt.backend, normalize_ref(rt.image))
                meta_group = task.metadata.get("group_id")
                group = meta_group if isinstance(meta_group, str) else s.task_id
            if len(self._needs) > 10_000:  # tasks that ended long ago
                self._needs.clear()
            need = self._needs[s.task_id] = Need(image, group)
        return need

    # -- the loop ---------------------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.time()
        views = self.node_views(now)
        by_id = {v.node_id: v for v in views}
        contact = {n.node_id: n.last_contact for n in self.store.nodes()}
        on_nodes = self.store.on_nodes()
        for s in on_nodes:
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
        imaging = any(v.engines for v in views)  # nodes that report images: placement can use them
        if free == 0 and not imaging:
            return
        # The head of the queue: the free slots' worth, and with images as many again, so that sessions
        # whose image is on a busy node can be passed over and prefetches look ahead.
        waiting = self.store.queued(free + (sum(v.capacity for v in views) if imaging else 0))
        queue = {s.session_id: s for s in (waiting if imaging else waiting[:free])}
        needs: dict[str, Need] | None = None
        placed: dict[str, Counter[str]] | None = None
        skipped: set[str] = set()
        if imaging:
            needs = {sid: self._need(s) for sid, s in queue.items()}
            placed = {}
            for s in on_nodes:
                assert s.node_id is not None
                placed.setdefault(self._need(s).group, Counter())[s.node_id] += 1
            views = with_arrivals(views, [(s.node_id or "", self._need(s).image) for s in on_nodes])
        pairs = place(
            list(queue),
            views,
            needs,
            placed,
            waited={sid: now - t for sid, t in self._passed_over.items()},
            locality_wait_s=self.config.locality_wait_s,
            skipped=skipped,
        )
        for sid in skipped:
            self._passed_over.setdefault(sid, now)
        if imaging:
            chosen = {sid for sid, _ in pairs}
            later = [self._need(s).image for sid, s in queue.items() if sid not in chosen]
            arrived = with_arrivals(views, [(node, self._need(queue[sid]).image) for sid, node in pairs])
            self.prefetching = prefetch(later, arrived)
        for session_id, node_id in pairs:
            s = queue[session_id]
            self._passed_over.pop(session_id, None)
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
