"""Scheduling decisions as pure functions: placement, when to ask a node, what a dispatch answer means."""

from __future__ import annotations

import pytest

from polar.rollout.server.scheduler import (
    DispatchOutcome,
    NodeView,
    Probe,
    classify_dispatch,
    is_gone,
    is_healthy,
    place,
    probe_decision,
)


def node(node_id: str, capacity: int = 2, load: int = 0, **kw: bool) -> NodeView:
    return NodeView(
        node_id,
        f"http://{node_id}",
        capacity,
        load,
        kw.get("healthy", True),
        kw.get("draining", False),
        kw.get("lost", False),
    )


def test_least_loaded_node_first_by_fraction() -> None:
    nodes = [node("a", capacity=4, load=2), node("b", capacity=2, load=0), node("c", capacity=8, load=2)]
    # fractions: a 0.5, b 0.0, c 0.25 -> b, then b(0.5) vs c(0.25) -> c, then c(0.375) ...
    assert place(["s1", "s2", "s3"], nodes) == [("s1", "b"), ("s2", "c"), ("s3", "c")]


def test_ties_go_to_more_free_slots_then_node_id() -> None:
    nodes = [node("b", capacity=2), node("a", capacity=2), node("c", capacity=4)]
    assert place(["s1"], nodes) == [("s1", "c")]
    assert place(["s1"], [node("b"), node("a")]) == [("s1", "a")]


def test_admission_limit_is_never_exceeded_and_queue_order_is_kept() -> None:
    nodes = [node("a", capacity=2, load=1), node("b", capacity=1)]
    out = place([f"s{i}" for i in range(5)], nodes)
    assert [s for s, _ in out] == ["s0", "s1"]  # only two free slots; the first two in priority order
    assert sorted(n for _, n in out) == ["a", "b"]


@pytest.mark.parametrize("flag", ["healthy", "draining", "lost"])
def test_unhealthy_draining_and_lost_nodes_get_nothing(flag: str) -> None:
    bad = node("a", **{flag: flag != "healthy"})
    assert not bad.admits
    assert place(["s1", "s2"], [bad, node("b", capacity=1)]) == [("s1", "b")]
    assert place(["s1"], [bad]) == []


def test_health_clocks() -> None:
    assert is_healthy(last_heartbeat=100.0, now=110.0, heartbeat_timeout_s=15.0)
    assert not is_healthy(last_heartbeat=100.0, now=116.0, heartbeat_timeout_s=15.0)
    assert is_gone(last_contact=100.0, now=221.0, node_lost_after_s=120.0)
    assert not is_gone(last_contact=100.0, now=219.0, node_lost_after_s=120.0)


def _decide(
    confirmed: bool = True, in_flight: bool = False, n: NodeView | None = None, contact: float = 95.0
) -> Probe:
    return probe_decision(
        confirmed=confirmed,
        dispatch_in_flight=in_flight,
        node=node("a") if n is None else n,
        last_contact=contact,
        now=100.0,
        node_lost_after_s=60.0,
    )


def test_probe_decisions() -> None:
    assert _decide() is Probe.NONE  # confirmed on a healthy node: it will call back
    assert _decide(confirmed=False) is Probe.ASK  # a lost dispatch answer: ask before anything else
    assert _decide(confirmed=False, in_flight=True) is Probe.NONE  # the dispatch itself will settle it
    assert _decide(n=node("a", healthy=False)) is Probe.ASK  # missed heartbeats: does it still have it?
    assert _decide(n=node("a", healthy=False), contact=30.0) is Probe.LOST  # silent for > 60 s
    assert _decide(n=node("a", lost=True)) is Probe.LOST


@pytest.mark.parametrize(
    ("status", "connect_failed", "outcome"),
    [
        (202, False, DispatchOutcome.ACCEPTED),
        (200, False, DispatchOutcome.ACCEPTED),
        (None, True, DispatchOutcome.REFUSED),  # never sent
        (503, False, DispatchOutcome.REFUSED),  # full or draining
        (429, False, DispatchOutcome.REFUSED),
        (400, False, DispatchOutcome.REJECTED),  # the node cannot run this spec
        (422, False, DispatchOutcome.REJECTED),
        (None, False, DispatchOutcome.UNKNOWN),  # sent, answer lost: the node may have it
        (409, False, DispatchOutcome.UNKNOWN),  # "already seen": it may be running it
        (500, False, DispatchOutcome.UNKNOWN),
    ],
)
def test_dispatch_answers(status: int | None, connect_failed: bool, outcome: DispatchOutcome) -> None:
    assert classify_dispatch(status, connect_failed=connect_failed) is outcome
