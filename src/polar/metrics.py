"""Prometheus metrics of polar's servers, served at `GET /metrics` on each server's control listener.

`/metrics` is a control route like the others: it needs the control token and is never on the model API a
sandbox reaches (a scrape reveals load, backends and session counts). Each app has its own
`CollectorRegistry` (several gateways, nodes and servers share a process in `polar run` and in tests, where
the global default registry would collide).

Counters and histograms are moved once per call (never per token). Gauges of current state (sessions by
stage, pool occupancy, calls in flight) are read from the live objects at scrape time by a `LiveCollector`,
so they cost nothing between scrapes. Names, types and labels: docs/prometheus.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from starlette.requests import Request
from starlette.responses import Response

# Seconds a model call takes upstream: from a short tool-call turn to a long generation.
UPSTREAM_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Seconds the gateway itself adds (parse, record): milliseconds, or worse under store contention.
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LiveCollector:
    """A collector whose families are computed by `read()` at each scrape (the `Collector` protocol)."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        return list(self.read())


def gauge(
    name: str, doc: str, values: Mapping[tuple[str, ...], float], labels: tuple[str, ...] = ()
) -> Metric:
    """A gauge family with one sample per label tuple in `values` (`{(): v}` for an unlabelled one)."""
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    for key, value in values.items():
        family.add_metric(list(key), value)
    return family


def counter(
    name: str, doc: str, values: Mapping[tuple[str, ...], float], labels: tuple[str, ...] = ()
) -> Metric:
    """A counter family read from a live total (`name` without `_total`; the library appends it)."""
    family = CounterMetricFamily(name, doc, labels=list(labels))
    for key, value in values.items():
        family.add_metric(list(key), value)
    return family


class BusyClock:
    """Calls in flight on one server, and the seconds it had at least one: the rate of the busy seconds is
    the server's busy fraction (`rate(polar_gateway_backend_busy_seconds_total[1m])`). The clock is read
    only when the count leaves or reaches zero."""

    __slots__ = ("_busy", "_since", "in_flight")

    def __init__(self) -> None:
        self.in_flight = 0
        self._busy = 0.0
        self._since = 0.0

    def enter(self) -> None:
        if self.in_flight == 0:
            self._since = time.monotonic()
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._busy += time.monotonic() - self._since

    def seconds(self) -> float:
        """Busy seconds so far, the current busy stretch included."""
        return self._busy + (time.monotonic() - self._since if self.in_flight else 0.0)


async def metrics_endpoint(request: Request) -> Response:
    """`GET /metrics`: the app's registry (`state.metrics_registry`) in the exposition format the scraper
    asks for (Prometheus text, or OpenMetrics)."""
    registry: CollectorRegistry = request.app.state.metrics_registry
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(registry), media_type=content_type)
