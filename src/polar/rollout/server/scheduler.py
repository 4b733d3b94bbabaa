"""Scheduling decisions, as pure functions over node and session states (the I/O lives in `dispatch`).

Placement: each queued session (highest task priority first, then submission order, then sample index)
goes to the healthy, non-draining node with the lowest load fraction that is under its admission limit
(`capacity`). A node's load is the number of open sessions this server has placed on it: it is exact the
moment a dispatch is decided, while a heartbeat's `active` lags by up to one heartbeat interval.

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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class NodeView:
    node_id: str
    url: str
    capacity: int
    load: int  # open sessions this server placed there
    healthy: bool  # heartbeat seen within heartbeat_timeout_s
    draining: bool
    lost: bool = False

    @property
    def admits(self) -> bool:
        return self.healthy and not self.draining and not self.lost and self.load < self.capacity


def is_healthy(last_heartbeat: float, now: float, heartbeat_timeout_s: float) -> bool:
    return now - last_heartbeat <= heartbeat_timeout_s


def is_gone(last_contact: float, now: float, node_lost_after_s: float) -> bool:
    return now - last_contact > node_lost_after_s


def place(queue: Iterable[str], nodes: Sequence[NodeView]) -> list[tuple[str, str]]:
    """Assign queued session ids (already in priority order) to nodes; stops when no node admits more.

    Returns (session_id, node_id) pairs. Ties on load fraction go to the node with more free slots, then
    to the node id, so the outcome is deterministic."""
    load = {n.node_id: n.load for n in nodes}
    eligible = [n for n in nodes if n.admits]
    out: list[tuple[str, str]] = []
    for session_id in queue:
        open_nodes = [n for n in eligible if load[n.node_id] < n.capacity]
        if not open_nodes:
            break
        best = min(
            open_nodes,
            key=lambda n: (load[n.node_id] / n.capacity, -(n.capacity - load[n.node_id]), n.node_id),
        )
        load[best.node_id] += 1
        out.append((session_id, best.node_id))
    return out


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
