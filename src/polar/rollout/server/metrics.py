"""The rollout server's Prometheus metrics (`polar.metrics`; the table is in docs/prometheus.md).

Everything is read at scrape time: tasks, sessions, the queue and callbacks from the server's store (so the
numbers survive a restart, like the state they count), nodes as the scheduler sees them, and the counters
the callback deliverer and the security log keep since the server started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from polar.metrics import LiveCollector, counter, gauge
from polar.rollout.protocol import SessionStatus

if TYPE_CHECKING:
    from polar.rollout.server.service import RolloutService

TASK_STATES = ("ACTIVE", "DONE", "CANCELLED")
CALLBACK_STATES = ("pending", "delivered", "failed")


def server_registry(service: Callable[[], RolloutService | None]) -> CollectorRegistry:
    """A registry reading `service()` (None until the app's lifespan made it) at each scrape."""
    registry = CollectorRegistry()
    registry.register(LiveCollector(lambda: live(service())))
    return registry


def live(svc: RolloutService | None) -> Iterator[Metric]:
    if svc is None:
        return
    store = svc.store
    tasks = store.task_states()
    yield gauge(
        "polar_server_tasks", "Tasks by state.", {(s,): tasks.get(s, 0) for s in TASK_STATES}, ("state",)
    )
    sessions = store.counts()
    yield gauge(
        "polar_server_sessions",
        "Sessions by status (REGISTERED: not yet accepted by a node).",
        {(s.value,): sessions.get(s.value, 0) for s in SessionStatus},
        ("status",),
    )
    yield gauge(
        "polar_server_queue_depth", "Sessions of active tasks waiting for a node.", {(): store.queue_depth()}
    )
    views = svc.node_views(time.time())
    by = ("node",)
    yield gauge(
        "polar_server_node_up",
        "1 while a registered node is healthy (heartbeats arriving, not lost).",
        {(v.node_id,): int(v.healthy and not v.lost) for v in views},
        by,
    )
    yield gauge(
        "polar_server_node_capacity",
        "Sessions each node admits.",
        {(v.node_id,): v.capacity for v in views},
        by,
    )
    yield gauge(
        "polar_server_node_load",
        "Open sessions this server placed on each node.",
        {(v.node_id,): v.load for v in views},
        by,
    )
    yield gauge(
        "polar_server_node_draining",
        "1 while a node takes no new sessions.",
        {(v.node_id,): int(v.draining) for v in views},
        by,
    )
    healthy = sum(v.healthy and not v.lost for v in views)
    lost = sum(v.lost for v in views)
    yield gauge(
        "polar_server_nodes",
        "Registered nodes: healthy, unhealthy (missing heartbeats), lost (given up on).",
        {("healthy",): healthy, ("unhealthy",): len(views) - healthy - lost, ("lost",): lost},
        ("state",),
    )
    callbacks = store.callback_states()
    yield gauge(
        "polar_server_callbacks",
        "Trainer callbacks by state (failed: every attempt failed or the destination was refused).",
        {(s,): callbacks.get(s, 0) for s in CALLBACK_STATES},
        ("state",),
    )
    yield counter(
        "polar_server_callback_attempts",
        "Callback delivery attempts since start, by outcome: delivered, retried (failed, tried again), "
        "failed (given up).",
        {(k,): v for k, v in svc.deliverer.attempts.items()},
        ("outcome",),
    )
    security = svc.security
    yield counter(
        "polar_server_auth_refused",
        "Requests refused for a missing or wrong control token since start.",
        {(): security.auth_refused},
    )
    yield counter(
        "polar_server_results_refused",
        "Session results refused since start: not from the node the session was dispatched to.",
        {(): security.results_refused},
    )
