"""Several inference servers of one kind behind one gateway, as one `Backend`.

Why each rule:
- **Least outstanding requests**: agent calls vary from milliseconds to minutes, so counting calls in
  flight per server balances load where round robin piles long calls onto one server.
- **Session affinity**: a session's next prompt extends its previous one, and only the server that
  served it holds that prefix in its KV cache; a session stays pinned to its server while that server is
  usable, and new sessions go to the least loaded one (fewest pinned sessions on a tie).
- **Health**: every `health_interval_s` each server's `/v1/models` is read (liveness, and the served
  models must stay those every server listed at start-up). A server that fails the probe, or a call with
  `UpstreamUnavailable` (nothing was delivered), gets no new calls until a probe succeeds again; the failed
  call moves to another server and its session is re-pinned there, so sessions move instead of failing.
  With no usable server left, the unhealthy ones are still tried (one may be back before the probe says so).
- **Disabled**: a server taken out of rotation on purpose (a weight sync that failed on it leaves it
  paused or half-loaded) stays out, healthy or not, until it is enabled again.

Servers are clients made by `make_backend` with no retries of their own: the pool retries, on another
server first, in up to `options.retries` more rounds with the options' backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from polar.gateway.backends.base import Backend, BackendOptions
from polar.gateway.backends.http import UpstreamUnavailable
from polar.gateway.backends.prompt_ids import IdsMemo
from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk
from polar.gateway.errors import GatewayError
from polar.gateway.render.chain import Chain
from polar.metrics import BusyClock

log = logging.getLogger("polar.gateway")

T = TypeVar("T")
# Failures that are the server's, not the request's: counted per server.
_SERVER_FAULTS = frozenset(("upstream_error", "timeout"))


@dataclass(eq=False)
class Server:
    """One server of the pool and what the pool knows of it."""

    backend: Backend
    index: int
    healthy: bool = True
    enabled: bool = True
    clock: BusyClock = field(default_factory=BusyClock)  # calls in flight now, and busy seconds
    calls: int = 0  # calls sent, failed ones included
    failures: int = 0  # calls that failed for the server's fault
    sessions: int = 0  # sessions pinned here
    last_error: str | None = None

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def outstanding(self) -> int:
        return self.clock.in_flight

    @property
    def usable(self) -> bool:
        return self.healthy and self.enabled

    def state(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "enabled": self.enabled,
            "outstanding": self.outstanding,
            "calls": self.calls,
            "failures": self.failures,
            "sessions": self.sessions,
            "last_error": self.last_error,
        }


class BackendPool:
    """`Backend` over several servers of one `kind` (see the module doc). `complete` takes the session id
    for affinity; everything else in the protocol works as for one server."""

    def __init__(
        self,
        servers: Sequence[Backend],
        options: BackendOptions,
        *,
        affinity: bool = True,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 10.0,
        max_pinned: int = 16_384,
    ) -> None:
        if len(servers) < 1:
            raise ValueError("a backend pool needs at least one server")
        kinds = {s.kind for s in servers}
        if len(kinds) != 1:
            raise ValueError(f"a backend pool's servers must be of one kind, not {sorted(kinds)}")
        self.kind = servers[0].kind
        self.url = ",".join(s.url for s in servers)
        self.options = options  # what side-call backends copy (`Proxy.side_backend`)
        self.servers = [Server(b, i) for i, b in enumerate(servers)]
        self.affinity = affinity
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.models: frozenset[str] | None = None  # what every server must list; set by `resolve_model`
        # session id -> server, least recently used first; bounded, since sessions that end without a
        # `forget` (a gateway's sessions are closed by the registry, not here) must not accumulate.
        self._pins: OrderedDict[str, Server] = OrderedDict()
        self._max_pinned = max_pinned
        self._turn = 0  # rotates the tie-break so equal servers share new sessions
        self._watch: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, kind: str, urls: Sequence[str], options: BackendOptions, **settings: Any) -> BackendPool:
        """A pool of `kind` servers at `urls`; each server's client has no retries (the pool's)."""
        from polar.gateway.backends import make_backend

        single = replace(options, retries=0)
        return cls([make_backend(kind, url, single) for url in urls], options, **settings)

    # -- the Backend protocol --------------------------------------------------------------------------
    def build_body(self, req: CanonicalRequest, served_model: str) -> dict[str, Any]:
        return self.servers[0].backend.build_body(req, served_model)

    async def complete(
        self,
        body: dict[str, Any],
        memo: IdsMemo | None = None,
        chain: Chain | None = None,
        session: str | None = None,
    ) -> Completion:
        """Send `body` to `session`'s server (or the least loaded usable one), moving on when a server
        delivers nothing."""
        return await self._on_server(session, lambda b: b.complete(body, memo, chain))

    async def stream(
        self,
        body: dict[str, Any],
        memo: IdsMemo | None = None,
        chain: Chain | None = None,
        session: str | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """`complete`, streamed: the call moves to another server only until its first chunk (after that
        the harness has seen tokens, and a failure ends its stream)."""

        async def first_chunk(backend: Backend) -> tuple[AsyncGenerator[StreamChunk, None], StreamChunk]:
            chunks = backend.stream(body, memo, chain)
            try:
                return chunks, await anext(chunks)
            except StopAsyncIteration:
                raise GatewayError(
                    "upstream_error", f"inference server at {backend.url} ended the stream before any chunk"
                ) from None
            except BaseException:
                await chunks.aclose()
                raise

        server, (chunks, first) = await self._acquire(session, first_chunk)
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except GatewayError as err:
            self._fault(server, err)
            raise
        finally:
            server.clock.leave()
            await chunks.aclose()

    async def check_token_data(self, served_model: str) -> None:
        """Every server must return token data; one that cannot answer the check is skipped with a warning
        (`TokenDataMissing` from any server is raised)."""
        for s in self.servers:
            try:
                await s.backend.check_token_data(served_model)
            except GatewayError as err:
                log.warning("could not check the token data of %s: %s", s.url, err.message)

    async def count_tokens(self, req: CanonicalRequest, served_model: str) -> int:
        return await self._on_server(None, lambda b: b.count_tokens(req, served_model))

    async def list_models(self) -> list[str]:
        return await self._on_server(None, lambda b: b.list_models())

    async def start(self) -> None:
        for s in self.servers:
            await s.backend.start()
        if self._watch is None and self.health_interval_s > 0:
            self._watch = asyncio.create_task(self._watch_health(), name="polar-backend-health")

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        for s in self.servers:
            await s.backend.aclose()

    # -- placement -------------------------------------------------------------------------------------
    async def _on_server(self, session: str | None, fn: Callable[[Backend], Awaitable[T]]) -> T:
        server, result = await self._acquire(session, fn)
        server.clock.leave()
        return result

    async def _acquire(self, session: str | None, fn: Callable[[Backend], Awaitable[T]]) -> tuple[Server, T]:
        """`fn` on `session`'s server, or the next one while servers deliver nothing; the server it
        succeeded on keeps the call counted in `outstanding` until the caller gives it back."""
        last: GatewayError | None = None
        for round_ in range(self.options.retries + 1):
            if round_:
                await asyncio.sleep(self.options.retry_backoff_s * 2 ** (round_ - 1))
            tried: set[Server] = set()
            while (server := self._choose(session, tried)) is not None:
                tried.add(server)
                server.clock.enter()
                server.calls += 1
                try:
                    return server, await fn(server.backend)
                except UpstreamUnavailable as err:
                    server.clock.leave()
                    server.failures += 1
                    self._down(server, err.message)
                    last = err
                except GatewayError as err:
                    server.clock.leave()
                    self._fault(server, err)
                    raise
                except BaseException:
                    server.clock.leave()
                    raise
        if last is None:
            raise GatewayError("upstream_error", "every inference server is out of rotation (disabled)")
        raise last

    def _choose(self, session: str | None, tried: set[Server]) -> Server | None:
        """The session's server if usable, else the usable server with the fewest calls in flight (then
        fewest pinned sessions); with none usable, an enabled unhealthy one not tried yet."""
        candidates = [s for s in self.servers if s.usable and s not in tried]
        if not candidates:
            candidates = [s for s in self.servers if s.enabled and s not in tried]
            if not candidates:
                return None
        key = session if self.affinity else None
        if key is not None:
            pinned = self._pins.get(key)
            if pinned is not None and pinned in candidates:
                self._pins.move_to_end(key)
                return pinned
        n = len(self.servers)
        turn = self._turn
        self._turn = (turn + 1) % n
        chosen = min(
            candidates,
            key=lambda s: (s.outstanding, s.sessions if self.affinity else 0, (s.index - turn) % n),
        )
        if key is not None:
            self._pin(key, chosen)
        return chosen

    def _pin(self, session: str, server: Server) -> None:
        old = self._pins.pop(session, None)
        if old is not None:
            old.sessions -= 1
        self._pins[session] = server
        server.sessions += 1
        while len(self._pins) > self._max_pinned:
            _, evicted = self._pins.popitem(last=False)
            evicted.sessions -= 1

    def forget(self, session: str) -> None:
        """A closed session's pin is dropped (its server's cache will not be asked for it again)."""
        server = self._pins.pop(session, None)
        if server is not None:
            server.sessions -= 1

    def server_of(self, session: str) -> str | None:
        """The URL `session` is pinned to, if any."""
        server = self._pins.get(session)
        return server.url if server is not None else None

    # -- health ----------------------------------------------------------------------------------------
    def _fault(self, server: Server, err: GatewayError) -> None:
        if err.kind in _SERVER_FAULTS:
            server.failures += 1
            server.last_error = err.message

    def _down(self, server: Server, why: str) -> None:
        server.last_error = why
        if server.healthy:
            server.healthy = False
            log.warning("inference server %s out of rotation: %s", server.url, why)

    def set_enabled(self, url: str, enabled: bool) -> bool:
        """Take a server out of rotation (or back in); False if no server has that URL."""
        url = url.rstrip("/")
        for s in self.servers:
            if s.url == url:
                if s.enabled != enabled:
                    log.warning("inference server %s %s", s.url, "enabled" if enabled else "disabled")
                s.enabled = enabled
                return True
        return False

    async def _models(self, server: Server) -> list[str] | GatewayError:
        try:
            return await asyncio.wait_for(server.backend.list_models(), self.health_timeout_s)
        except GatewayError as err:
            return err
        except TimeoutError:
            return GatewayError("timeout", f"no answer within {self.health_timeout_s:g} s")

    async def probe(self, server: Server) -> bool:
        """Read `server`'s models once; healthy if it answers with the pool's models."""
        models = await self._models(server)
        if isinstance(models, GatewayError):
            self._down(server, models.message)
            return False
        if self.models is None:
            self.models = frozenset(models)
        elif frozenset(models) != self.models:
            self._down(server, f"serves {sorted(models)}, not {sorted(self.models)} like the others")
            return False
        if not server.healthy:
            log.warning("inference server %s back in rotation", server.url)
        server.healthy, server.last_error = True, None
        return True

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await asyncio.gather(*(self.probe(s) for s in self.servers))
            except Exception:  # a bug here must not end health checking for the gateway's life
                log.exception("health check of the inference servers failed")

    async def resolve_model(self, served_model: str | None) -> str:
        """The model to serve: `served_model`, else the one every server lists first. Every server that
        answers must list the same models (one line naming each otherwise); one that does not answer
        starts out of rotation until a probe reaches it. Raises RuntimeError (a start-up failure)."""
        answers = await asyncio.gather(*(self._models(s) for s in self.servers))
        listed: dict[str, list[str]] = {}
        for server, models in zip(self.servers, answers, strict=True):
            if isinstance(models, GatewayError):
                self._down(server, models.message)
            else:
                listed[server.url] = models
        if not listed:
            if served_model is not None:
                return served_model
            why = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
            raise RuntimeError(f"could not list any inference server's models ({why}); pass --model")
        if len({frozenset(m) for m in listed.values()}) > 1:
            each = ", ".join(f"{url} serves {sorted(m)}" for url, m in listed.items())
            raise RuntimeError(f"the inference servers do not serve the same model: {each}")
        first = next(iter(listed.values()))
        self.models = frozenset(first)
        if served_model is not None:
            return served_model
        if not first:
            raise RuntimeError(f"the inference servers at {self.url} list no model; pass --model")
        return first[0]

    def state(self) -> list[dict[str, Any]]:
        """Per-server state for the control listener (never the model API: it names internal addresses)."""
        return [s.state() for s in self.servers]
