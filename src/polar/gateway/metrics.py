"""The gateway's Prometheus metrics (`polar.metrics`; the table is in docs/prometheus.md).

`GatewayMetrics` holds what is counted as calls happen (calls by dialect and status, refusals, failures,
tokens, latencies), each moved once per call: the proxy's hot path pays a few dict updates and three
histogram observations. Everything else (live sessions, calls in flight, the weight-sync gate, each
inference server's load, health and busy seconds, the record store's commits) is read from the proxy at
scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import Metric

from polar.gateway.backends.base import Backend
from polar.gateway.backends.pool import BackendPool
from polar.gateway.gate import Gate
from polar.metrics import FAST_BUCKETS, UPSTREAM_BUCKETS, BusyClock, LiveCollector, counter, gauge
from polar.store.writer import AsyncWriter

AUTHENTICATION = "authentication"  # the refusal reason of a call without a live session's key


class Released(Protocol):
    """What the idle sweep gave back (`polar.gateway.sessions.Releases`)."""

    @property
    def count(self) -> int: ...
    @property
    def bytes(self) -> int: ...


class Sessions(Sized, Protocol):
    @property
    def released(self) -> Released: ...


class Watched(Protocol):
    """What a scrape reads of the proxy (`polar.gateway.proxy.Proxy` is one): declared here, so the metrics
    import nothing above them."""

    @property
    def backend(self) -> Backend: ...
    @property
    def pool(self) -> BackendPool | None: ...
    @property
    def gate(self) -> Gate: ...
    @property
    def writer(self) -> AsyncWriter: ...
    @property
    def sessions(self) -> Sessions: ...


class GatewayMetrics:
    """What the proxy counts as calls happen. Counts are plain ints in dicts (the proxy runs on one event
    loop), exposed as counters at scrape time: a counter of the client library takes a lock per increment,
    several times the cost of a dict update. Latencies go to the library's histograms."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.calls: dict[tuple[str, int], int] = {}  # (dialect, HTTP status) -> calls answered
        self.refused: dict[tuple[str, str], int] = {}  # (dialect, reason)
        self.failures: dict[tuple[str, str], int] = {}  # (dialect, error kind)
        self.records = self.prompt_tokens = self.completion_tokens = 0
        self.passed_on = 0  # requests passed to their session's owner (`--workers`)
        r = self.registry
        self.upstream = Histogram(
            "polar_gateway_upstream_seconds",
            "Time an inference server took for a call that completed (a whole answer, or a stream from "
            "request to last chunk).",
            buckets=UPSTREAM_BUCKETS,
            registry=r,
        )
        self.commit = Histogram(
            "polar_gateway_record_commit_seconds",
            "Time from handing a completion record to the store writer to its commit (the harness waits "
            "for it).",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "polar_gateway_overhead_seconds",
            "Time a completed call spent in the gateway before its record, upstream excluded (reading, "
            "parsing, placing).",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        r.register(LiveCollector(self._counted))

    def answered(self, dialect: str, status: int) -> None:
        key = (dialect, status)
        self.calls[key] = self.calls.get(key, 0) + 1

    def refusal(self, dialect: str, reason: str) -> None:
        key = (dialect, reason)
        self.refused[key] = self.refused.get(key, 0) + 1

    def failure(self, dialect: str, kind: str) -> None:
        key = (dialect, kind)
        self.failures[key] = self.failures.get(key, 0) + 1

    def committed(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        upstream_s: float,
        commit_s: float,
        overhead_s: float,
    ) -> None:
        self.records += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.upstream.observe(upstream_s)
        self.commit.observe(commit_s)
        self.overhead.observe(overhead_s)

    def _counted(self) -> Iterator[Metric]:
        yield counter(
            "polar_gateway_passed_on",
            "Model API requests that reached a worker other than their session's owner and were passed to "
            "it (`--workers`): clients that call the shared port rather than their session's base_url.",
            {(): self.passed_on},
            (),
        )
        yield counter(
            "polar_gateway_calls",
            "Generation calls answered, by dialect and HTTP status.",
            {(d, str(status)): n for (d, status), n in list(self.calls.items())},
            ("dialect", "status"),
        )
        yield counter(
            "polar_gateway_refused",
            "Generation calls refused before reaching an inference server, by reason (authentication, or "
            "the error kind of a body that could not be read, parsed or placed).",
            {tuple(k): n for k, n in list(self.refused.items())},
            ("dialect", "reason"),
        )
        yield counter(
            "polar_gateway_call_failures",
            "Failure records stored, by dialect and error kind (streams that failed after their 200 included).",
            {tuple(k): n for k, n in list(self.failures.items())},
            ("dialect", "kind"),
        )
        yield counter("polar_gateway_records_committed", "Completion records committed.", {(): self.records})
        yield counter(
            "polar_gateway_prompt_tokens", "Prompt tokens of committed completions.", {(): self.prompt_tokens}
        )
        yield counter(
            "polar_gateway_completion_tokens",
            "Completion tokens of committed completions.",
            {(): self.completion_tokens},
        )

    def watch(self, proxy: Callable[[], Watched | None]) -> None:
        """Read the live state of `proxy()` (None until the gateway's lifespan made it) at each scrape."""
        self.registry.register(LiveCollector(lambda: live(proxy())))


@dataclass(frozen=True)
class _Server:
    url: str
    clock: BusyClock
    up: bool
    calls: int
    failures: int
    sessions: int


def _servers(proxy: Watched) -> list[_Server]:
    if proxy.pool is None:  # one server: its calls are those through the gate
        return [_Server(proxy.backend.url, proxy.gate.clock, True, 0, 0, 0)]
    return [_Server(s.url, s.clock, s.usable, s.calls, s.failures, s.sessions) for s in proxy.pool.servers]


def live(proxy: Watched | None) -> Iterator[Metric]:
    """The gateway's current state: sessions, gate, inference servers, store writer."""
    if proxy is None:
        return
    gate, writer = proxy.gate, proxy.writer
    yield gauge(
        "polar_gateway_sessions_live",
        "Sessions held in memory (open, recently used).",
        {(): len(proxy.sessions)},
    )
    released = proxy.sessions.released
    yield counter(
        "polar_gateway_memory_releases",
        "Times the idle sweep gave memory back (no session live after some were).",
        {(): released.count},
    )
    yield counter(
        "polar_gateway_memory_released_bytes",
        "Resident bytes those releases returned to the system (RSS before minus after).",
        {(): released.bytes},
    )
    yield gauge(
        "polar_gateway_in_flight",
        "Generation calls in flight through the weight-sync gate.",
        {(): gate.in_flight},
    )
    yield gauge(
        "polar_gateway_paused", "1 while the gate is paused for a weight sync.", {(): int(gate.paused)}
    )
    servers, by = _servers(proxy), ("backend",)
    yield gauge(
        "polar_gateway_backend_in_flight",
        "Calls in flight on each inference server.",
        {(s.url,): s.clock.in_flight for s in servers},
        by,
    )
    yield counter(
        "polar_gateway_backend_busy_seconds",
        "Seconds each inference server had at least one call in flight; its rate is the busy fraction.",
        {(s.url,): s.clock.seconds() for s in servers},
        by,
    )
    yield gauge(
        "polar_gateway_backend_up",
        "1 while an inference server is healthy and enabled (one server alone is not health-checked).",
        {(s.url,): int(s.up) for s in servers},
        by,
    )
    if proxy.pool is not None:
        yield counter(
            "polar_gateway_backend_calls",
            "Calls sent to each server of a pool.",
            {(s.url,): s.calls for s in servers},
            by,
        )
        yield counter(
            "polar_gateway_backend_failures",
            "Calls that failed for a pool server's fault.",
            {(s.url,): s.failures for s in servers},
            by,
        )
        yield gauge(
            "polar_gateway_backend_sessions",
            "Sessions pinned to each server of a pool.",
            {(s.url,): s.sessions for s in servers},
            by,
        )
    yield counter(
        "polar_gateway_store_commits", "Transactions the record store committed.", {(): writer.commits}
    )
    yield counter(
        "polar_gateway_store_writes",
        "Writes (records, failures, sessions) in those commits; writes per commit is the group-commit batch.",
        {(): writer.writes},
    )
    yield counter(
        "polar_gateway_store_lock_retries",
        "Commits put off because another process (a gateway worker) held the store's write lock.",
        {(): writer.lock_retries},
    )
