"""The node's Prometheus metrics, added to its gateway's registry: one `/metrics` on the node's control
listener answers for both (`polar.metrics`; the table is in docs/prometheus.md).

Evaluator outcomes and session ends are counted as they happen; sessions by stage, the stage pools, the
READY buffer and result delivery are read from the node at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import Metric

from polar.metrics import LiveCollector, counter, gauge
from polar.rollout.node.lifecycle import EVAL_OUTCOMES
from polar.rollout.protocol import SessionStatus

if TYPE_CHECKING:
    from polar.rollout.node.node import Node

_LIVE = [s for s in SessionStatus if not s.terminal and s is not SessionStatus.REGISTERED]


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry, node: Node) -> None:
        self.evaluations = Counter(
            "polar_node_evaluations",
            "Evaluations of completed runs, by outcome: passed, failed, scored (a reward without a "
            "verdict), error (the evaluator or its runtime failed), timeout.",
            ["outcome"],
            registry=registry,
        )
        self.ends = Counter(
            "polar_node_session_ends",
            "Sessions that ended on this node, by status.",
            ["status"],
            registry=registry,
        )
        # Every label value from the start: a rate over a series that appears late misses its first step.
        for outcome in EVAL_OUTCOMES:
            self.evaluations.labels(outcome)
        for status in SessionStatus:
            if status.terminal:
                self.ends.labels(status.value)
        registry.register(LiveCollector(lambda: live(node)))

    def evaluated(self, outcome: str) -> None:
        self.evaluations.labels(outcome).inc()

    def ended(self, status: SessionStatus) -> None:
        self.ends.labels(status.value).inc()


def live(node: Node) -> Iterator[Metric]:
    status = node.status()
    yield gauge(
        "polar_node_sessions",
        "Sessions admitted and not finished, by stage.",
        {(s.value,): status.by_stage.get(s.value, 0) for s in _LIVE},
        ("stage",),
    )
    yield gauge("polar_node_capacity", "Sessions the node admits at once.", {(): status.capacity})
    yield gauge("polar_node_draining", "1 while the node takes no new sessions.", {(): int(status.draining)})
    pools = [node.init_pool, node.run_pool, node.post_pool]
    by = ("pool",)
    yield gauge(
        "polar_node_pool_busy", "Workers of each stage pool held now.", {(p.name,): p.busy for p in pools}, by
    )
    yield gauge(
        "polar_node_pool_waiting",
        "Sessions waiting for a worker of each stage pool.",
        {(p.name,): p.waiting for p in pools},
        by,
    )
    yield gauge("polar_node_pool_size", "Workers of each stage pool.", {(p.name,): p.size for p in pools}, by)
    ready = node.ready
    yield gauge("polar_node_ready_buffer", "Prepared runtimes in the READY buffer.", {(): ready.busy})
    yield gauge("polar_node_ready_buffer_size", "Places in the READY buffer.", {(): ready.size})
    yield gauge(
        "polar_node_ready_buffer_waiting",
        "Sessions done with INIT waiting for a place in the READY buffer.",
        {(): ready.waiting},
    )
    reporter = node.reporter
    yield counter(
        "polar_node_result_reports",
        "Session results sent to the rollout server, by outcome: delivered, or failed (every attempt "
        "refused or unanswered; the server can still fetch the result).",
        {(k,): v for k, v in reporter.reports.items()},
        ("outcome",),
    )
    yield counter(
        "polar_node_heartbeat_failures",
        "Heartbeats that reached no rollout server.",
        {(): reporter.heartbeat_failures},
    )
