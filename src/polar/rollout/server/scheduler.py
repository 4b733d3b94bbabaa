"""Scheduling decisions, as pure functions over node and session states (the I/O lives in `dispatch`).

Placement: each queued session (highest task priority first, then submission order, then sample index)
goes to a healthy, non-draining node under its admission limit (`capacity`), preferring, in this order:
a node that holds the session's container image, then one already fetching it (a multi-GB image pulled
once per fleet, not once per node a group's samples scatter over), then the node holding most of the
session's group (its task's other samples: where the image is, or is coming), then the lowest load
fraction. Sessions that run in no container spread by load alone: nothing is fetched for them.
A node's load is the number of open sessions this server has placed on it: it is exact the moment a
dispatch is decided, while a heartbeat's `active` lags by up to one heartbeat interval. Images are never a
reason to wait: a free slot is filled even where the image must be fetched first, and `prefetch` asks
nodes to fetch the images of queued sessions that no node holds while their pools run.

Node loss, and why a session never runs twice: a node that misses heartbeats for `heartbeat_timeout_s`
becomes unhealthy and gets no new sessions. Its open sessions are *probed* (`GET /node/sessions/{id}`):
  - the node answers with the session: it keeps it (a terminal answer carries the result we missed);
  - the node answers 404: it never accepted it, so the session goes back to the queue under the same id;
  - the node does not answer: we wait. Once it has answered nothing at all for `node_lost_after_s`, it is
    gone for good and its open sessions end as ERROR "node lost". They are not re-run elsewhere, because
    the node may have run them (and may still be running them) without us knowing.
A dispatch whose answer was lost is sent once more (the node answers a dispatch it already accepted with
"duplicate"); if that is lost too, the same probe settles it: the session stays bound to the node until
the node confirms or denies having it. That probe carries the dispatch's result token, and the node fences
the dispatch before it answers 404, so a request still in flight inside the node can never be admitted
after the session was requeued (docs/nodes.md). Sessions on healthy nodes are also probed every
`audit_interval_s`, and all of a node's sessions when it registers again (it restarted) or when the server
starts: a node gives up delivering a result after a few retries, and these probes collect what it kept.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from functools import partial

Image = tuple[str, str]  # (engine, normalized reference): polar.runtime.inventory.normalize_ref


@dataclass(frozen=True)
class NodeView:
    node_id: str
    url: str
    capacity: int
    load: int  # open sessions this server placed there
    healthy: bool  # heartbeat seen within heartbeat_timeout_s
    draining: bool
    lost: bool = False
    images: frozenset[Image] = frozenset()  # what its engines hold (as last reported)
    fetching: frozenset[Image] = frozenset()  # what it is pulling now
    engines: frozenset[str] = frozenset()  # the engines it reports images of (empty: reports none)

    @property
    def admits(self) -> bool:
        return self.healthy and not self.draining and not self.lost and self.load < self.capacity


def is_healthy(last_heartbeat: float, now: float, heartbeat_timeout_s: float) -> bool:
    return now - last_heartbeat <= heartbeat_timeout_s


def is_gone(last_contact: float, now: float, node_lost_after_s: float) -> bool:
    return now - last_contact > node_lost_after_s


@dataclass(frozen=True)
class Need:
    """What placement knows of a queued session: its container image (None: it runs in none) and its group
    (the samples of one task, or the tasks sharing a `group_id`)."""

    image: Image | None
    group: str


def place(
    queue: Iterable[str],
    nodes: Sequence[NodeView],
    needs: Mapping[str, Need] | None = None,
    placed: Mapping[str, Counter[str]] | None = None,
    *,
    waited: Mapping[str, float] | None = None,
    locality_wait_s: float = 0.0,
    skipped: set[str] | None = None,
) -> list[tuple[str, str]]:
    """Assign queued session ids (already in priority order) to nodes; stops when no node admits more.

    `needs` gives each session's image and group (absent: neither), `placed` the open sessions of each
    group per node. A session whose image no free node holds or fetches, but a busy one does, is passed
    over (added to `skipped`) while it has waited for locality (`waited`: seconds since it was first
    passed over) less than `locality_wait_s`, and later sessions whose image a free node holds go first
    ("delay scheduling", Zaharia et al., EuroSys 2010: a short wait for a slot where the data is costs
    less than moving it). Returns (session_id, node_id) pairs. Ties go to the lower load fraction, then the
    node with more free slots, then the node id: deterministic."""
    load = {n.node_id: n.load for n in nodes}
    groups: dict[str, Counter[str]] = {g: Counter(c) for g, c in (placed or {}).items()}
    coming = {n.node_id: set(n.fetching) for n in nodes}  # a session placed where its image is not fetches it
    live = [n for n in nodes if n.healthy and not n.draining and not n.lost]
    eligible = [n for n in live if n.admits]
    out: list[tuple[str, str]] = []
    for session_id in queue:
        open_nodes = [n for n in eligible if load[n.node_id] < n.capacity]
        if not open_nodes:
            break
        need = (needs or {}).get(session_id)
        image = need.image if need is not None else None
        together = groups.setdefault(need.group, Counter()) if need and image else Counter()
        best = min(open_nodes, key=partial(_rank, image, together, load, coming))
        if (
            image is not None
            and _rank(image, together, load, coming, best)[0] == 2  # the image is neither on nor coming to it
            and (waited or {}).get(session_id, 0.0) < locality_wait_s
            and any(image in n.images or image in coming[n.node_id] for n in live)
        ):
            if skipped is not None:
                skipped.add(session_id)
            continue  # wait for a slot where the image is
        load[best.node_id] += 1
        together[best.node_id] += 1
        if image is not None and image not in best.images:
            coming[best.node_id].add(image)
        out.append((session_id, best.node_id))
    return out


def with_arrivals(
    nodes: Sequence[NodeView], open_sessions: Iterable[tuple[str, Image | None]]
) -> list[NodeView]:
    """The node views with the images of sessions placed there counted as fetching where not held: a
    container start pulls its image, and a node reports only the fetches it was asked for."""
    arriving: dict[str, set[Image]] = {}
    for node_id, image in open_sessions:
        if image is not None:
            arriving.setdefault(node_id, set()).add(image)
    return [
        replace(n, fetching=n.fetching | frozenset(arriving[n.node_id] - n.images))
        if n.node_id in arriving
        else n
        for n in nodes
    ]


def _rank(
    image: Image | None,
    together: Counter[str],
    load: Mapping[str, int],
    coming: Mapping[str, set[Image]],
    n: NodeView,
) -> tuple[int, int, float, int, str]:
    where = 0 if image is None or image in n.images else 1 if image in coming[n.node_id] else 2
    free = n.capacity - load[n.node_id]
    return (where, -together[n.node_id], load[n.node_id] / n.capacity, -free, n.node_id)


def prefetch(
    queue: Sequence[Image | None], nodes: Sequence[NodeView], per_node: int = 1
) -> dict[str, list[Image]]:
    """Which node should fetch which image now, so that queued sessions find their image where they land.

    `queue` is the images of the sessions still waiting after this round of placement, in queue order.
    An image is wanted on more nodes while more of its sessions wait than the nodes holding or fetching it
    have slots (an image no node holds: on one node, at least); each fetch goes to a node whose engines
    report images of its kind, the one with the fewest fetches under way (then the lowest load fraction,
    then its id), at most `per_node` new fetches each: a pull competes with running sessions for disk and
    network, and the next heartbeat asks again. Nodes that report no images are never asked (they cannot
    say what they hold)."""
    live = [n for n in nodes if n.healthy and not n.draining and not n.lost and n.engines]
    has = {n.node_id: set(n.images | n.fetching) for n in live}
    busy = {n.node_id: len(n.fetching) for n in live}
    demand = Counter(i for i in queue if i is not None)
    asked: dict[str, list[Image]] = {}
    for image in demand:  # queue order: the first waiting sessions' images first
        slots = sum(n.capacity for n in live if image in has[n.node_id])
        while demand[image] > slots:
            able = [
                n
                for n in live
                if image[0] in n.engines
                and image not in has[n.node_id]
                and len(asked.get(n.node_id, ())) < per_node
            ]
            if not able:
                break
            best = min(able, key=lambda n: (busy[n.node_id], n.load / n.capacity, n.node_id))
            asked.setdefault(best.node_id, []).append(image)
            busy[best.node_id] += 1
            has[best.node_id].add(image)
            slots += best.capacity
    return asked


class Probe(Enum):
    """What to do about an open session bound to a node, before asking the node anything."""

    NONE = "none"  # trust the node: it will call back
    ASK = "ask"  # ask the node whether it has the session
    LOST = "lost"  # the node is gone for good: end the session as ERROR "node lost"


def probe_decision(
    *,
    confirmed: bool,
    dispatch_in_flight: bool,
    node: NodeView | None,
    last_contact: float,
    now: float,
    node_lost_after_s: float,
    last_probe: float = 0.0,
    audit_interval_s: float = float("inf"),
) -> Probe:
    if dispatch_in_flight:
        return Probe.NONE  # the dispatch request itself will settle it
    if node is None:
        return Probe.LOST  # bound to a node this server has no record of (should not happen)
    if node.lost or is_gone(last_contact, now, node_lost_after_s):
        return Probe.LOST
    if not confirmed or not node.healthy or now - last_probe >= audit_interval_s:
        return Probe.ASK
    return Probe.NONE


class DispatchOutcome(Enum):
    ACCEPTED = "accepted"  # 2xx: the node has it
    REFUSED = "refused"  # the node certainly did not take it (connection refused, 401/403, 429/503): requeue
    REJECTED = "rejected"  # the node refused the spec itself (400/422): the session ends as ERROR
    UNKNOWN = "unknown"  # the answer was lost or ambiguous (timeout, 409, 5xx): ask before retrying


def classify_dispatch(status_code: int | None, *, connect_failed: bool = False) -> DispatchOutcome:
    """Map a dispatch attempt to what the server may conclude. `status_code` None: no answer arrived."""
    if connect_failed:
        return DispatchOutcome.REFUSED  # the request never left: httpx raises ConnectError before sending
    if status_code is None:
        return DispatchOutcome.UNKNOWN
    if 200 <= status_code < 300:
        return DispatchOutcome.ACCEPTED
    if status_code in (401, 403, 429, 503):  # 401/403: it refused our token before reading the spec
        return DispatchOutcome.REFUSED
    if status_code in (400, 404, 413, 422):
        return DispatchOutcome.REJECTED
    return DispatchOutcome.UNKNOWN  # 409 "already seen", 500: the node may hold it
