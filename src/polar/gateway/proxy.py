"""One model call, end to end: key → parse → normalize → upstream → record → answer in the caller's dialect.

This is the hot path. Its only network wait is the upstream call; the record is committed (group commit,
see `polar.gateway.recorder`) before the harness receives its answer, so a response the harness saw always
has its record. A failure after the key was accepted is recorded as a failure, never as a completion.

A streamed call (`stream: true`, Gemini's stream route) is streamed from the backend: each upstream chunk
is encoded in the harness's dialect as it arrives (`polar.gateway.relay`), the chunks are added up to the
same `Completion` a whole answer gives, and the stream's closing events go out only after its record is
committed. Layers: `call` -> `_call_handling_errors` -> `_prepare`, then `_call_single` (one answer) or
`_call_streamed` -> `relay` (a stream); both end in `Recorder.commit`. Around them: `gate` (weight syncs),
`answers` (the HTTP edges), `call` (what a call carries).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from polar import jsontypes
from polar.gateway.answers import (
    JSON,
    SSE_HEADERS,
    check_nesting,
    error_response,
    failure_response,
    parse_json,
    read_raw,
    render,
)
from polar.gateway.backends import make_backend
from polar.gateway.backends.base import Backend, BackendOptions
from polar.gateway.backends.pool import BackendPool
from polar.gateway.backends.prompt_ids import IdsMemo
from polar.gateway.call import Call, Placed
from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk
from polar.gateway.dialects.base import Dialect, StreamFormat
from polar.gateway.errors import GatewayError
from polar.gateway.fit import fit_max_tokens
from polar.gateway.gate import Gate
from polar.gateway.keys import session_key
from polar.gateway.metrics import AUTHENTICATION, GatewayMetrics, Watched
from polar.gateway.quirks import apply_quirks
from polar.gateway.recorder import Recorder
from polar.gateway.relay import Flight, RelayResponse, relay
from polar.gateway.render.chain import Chain
from polar.gateway.routing import SIDE_CALL, Classify, SideRoute, provisional_record
from polar.gateway.sessions import SessionRegistry, SessionState
from polar.gateway.signatures import ReasoningCodec
from polar.limits import DEFAULT_BODY_TIMEOUT_S
from polar.netguard import OutboundPolicy
from polar.store.writer import AsyncWriter

log = logging.getLogger("polar.gateway")


class Proxy:
    def __init__(
        self,
        backend: Backend,
        served_model: str,
        sessions: SessionRegistry,
        writer: AsyncWriter,
        codec: ReasoningCodec,
        max_body_bytes: int,
        outbound: OutboundPolicy | None = None,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.backend = backend
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        # Several servers: calls carry their session for affinity (`backends.pool`).
        self.pool = backend if isinstance(backend, BackendPool) else None
        self.served_model = served_model
        self.sessions = sessions
        self.writer = writer
        self.codec = codec
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.gate = Gate()
        # Side-call routes name task-given URLs: their connections go through this policy.
        self.outbound = outbound or OutboundPolicy()
        # Frozen backends for routed side calls, one per (kind, url), opened on first use.
        self._side_backends: dict[tuple[str, str], Backend] = {}
        self._side_lock = asyncio.Lock()
        self.recorder = Recorder(writer, self.metrics, self.gate)

    async def side_backend(self, route: SideRoute) -> Backend:
        """The (cached, started) client of a route's frozen backend, with the policy backend's timeouts
        and retries but not its API key, connecting only where the outbound policy allows."""
        key = (route.kind, route.url)
        backend = self._side_backends.get(key)
        if backend is not None:
            return backend
        async with self._side_lock:
            backend = self._side_backends.get(key)
            if backend is None:
                options = getattr(self.backend, "options", None) or BackendOptions()
                backend = make_backend(
                    route.kind, route.url, replace(options, api_key=None, outbound=self.outbound)
                )
                await backend.start()
                self._side_backends[key] = backend
        return backend

    async def close_session(self, session_id: str) -> bool:
        """Refuse the session's key from now on and drop its server affinity; False if there is no such
        session."""
        if self.pool is not None:
            self.pool.forget(session_id)
        return await self.sessions.close(session_id)

    async def aclose(self) -> None:
        """Finish the clean-ups of abandoned streams and close the side-call backends (the policy backend
        belongs to whoever made the proxy)."""
        await self.recorder.aclose()
        backends, self._side_backends = list(self._side_backends.values()), {}
        for backend in backends:
            await backend.aclose()

    @staticmethod
    def _side_tags(
        classify: Classify,
        state: SessionState,
        seq: int,
        dialect: Dialect,
        body: jsontypes.JSON,
        upstream: dict[str, Any],
        req: CanonicalRequest,
    ) -> tuple[str, ...]:
        try:
            return tuple(
                classify(provisional_record(state.session_id, seq, dialect.name, body, upstream, req))
            )
        except Exception as exc:  # the preset's bug, not the policy's: an infrastructure failure
            log.exception("side-call classifier failed for session %s call %d", state.session_id, seq)
            raise GatewayError("upstream_error", f"side-call classifier failed: {exc}") from None

    def authenticate(self, request: Request) -> SessionState:
        key = session_key(request)
        if key is None:
            raise GatewayError(
                "authentication",
                "no API key: pass the session id as Bearer token, x-api-key, x-goog-api-key or ?key=",
            )
        state = self.sessions.get(key)
        if state is None:
            raise GatewayError("authentication", "unknown API key: it is not a session of this gateway")
        if state.closed:
            raise GatewayError("authentication", f"session {key} is closed")
        return state

    async def call(
        self,
        dialect: Dialect,
        request: Request,
        *,
        path_model: str | None = None,
        path_stream: bool | None = None,
        stream_format: StreamFormat = "sse",
    ) -> Response:
        """Serve one generation call: authenticate its key, then `_call_handling_errors`.

        `stream_format` is "sse", or "json-array" for Gemini's stream route without `alt=sse`."""
        try:
            state = self.authenticate(request)
        except GatewayError as err:
            self.metrics.refusal(dialect.name, AUTHENTICATION)
            refused = error_response(dialect, err)
            self.metrics.answered(dialect.name, refused.status_code)
            return refused
        call = Call(state, state.take_seq(), dialect, time.time(), time.perf_counter())
        response: Response | None = None
        try:
            response = await self._call_handling_errors(call, request, path_model, path_stream, stream_format)
            self.metrics.answered(dialect.name, response.status_code)
            return response
        finally:
            # In flight until here, or for a stream until it ends: an idle session is never evicted mid-call.
            if not isinstance(response, RelayResponse):
                self.sessions.release(state)

    async def _call_handling_errors(
        self,
        call: Call,
        request: Request,
        path_model: str | None,
        path_stream: bool | None,
        stream_format: StreamFormat,
    ) -> Response:
        """A call's failure is recorded and answered in the caller's dialect (and stream grammar); its
        success is rendered in one of the dialect's three response shapes, or streamed as it is sampled."""
        placed: Placed | None = None
        try:
            placed = await self._prepare(call, request, path_model, path_stream)
            assert call.req is not None
            if call.req.stream:
                return await self._call_streamed(call, placed, stream_format)
            comp = await self._call_single(call, placed)
        except GatewayError as err:
            if placed is None:  # never reached an inference server: unreadable, unparseable, unplaceable
                self.metrics.refusal(call.dialect.name, err.kind)
            await self.recorder.failure(call, err)
            return failure_response(call, err, stream_format)
        return render(call.dialect, call.req, comp, self.codec)

    async def _prepare(
        self, call: Call, request: Request, path_model: str | None, path_stream: bool | None
    ) -> Placed:
        """Read and parse, normalize (quirks, restored tool arguments), place (policy or frozen side-call
        backend): everything before generation."""
        call.body = parse_json(await read_raw(request, self.max_body_bytes, self.body_timeout_s))
        check_nesting(call.body)  # before any generation: whatever is accepted can be stored
        req = call.dialect.parse(call.body, self.codec, path_model=path_model, path_stream=path_stream)
        req, quirks = apply_quirks(req)
        req, restored = call.state.tool_arguments.restore(req)
        if restored:
            quirks = (*quirks, "tool_arguments_restored")
        req, separated = call.state.tool_arguments.restore_separators(req)
        if separated:
            quirks = (*quirks, "tool_call_separator_restored")
        call.req = req
        return replace(await self._place(call, req), quirks=quirks)

    async def _call_single(self, call: Call, placed: Placed) -> Completion:
        """Generate in one upstream call, record: the completion, its record committed before anyone sees it."""
        await self.gate.enter()
        call.policy_version = self.gate.policy_version
        try:
            t_up = time.perf_counter()
            try:
                comp = await self._complete(call, placed)
            except GatewayError as err:
                placed = await self._fitted(call, placed, err)
                comp = await self._complete(call, placed)
            upstream_ms = (time.perf_counter() - t_up) * 1000.0
        finally:
            self.gate.leave()
        await self.recorder.commit(call, placed, comp, upstream_ms)
        return comp

    async def _complete(self, call: Call, placed: Placed) -> Completion:
        if self.pool is not None and placed.backend is self.pool:
            return await self.pool.complete(
                placed.upstream, call.state.ids_memo, call.state.chain, session=call.state.session_id
            )
        return await placed.backend.complete(
            placed.upstream, self._memo(call, placed), self._chain(call, placed)
        )

    def _stream(self, call: Call, placed: Placed) -> AsyncGenerator[StreamChunk, None]:
        if self.pool is not None and placed.backend is self.pool:
            return self.pool.stream(
                placed.upstream, call.state.ids_memo, call.state.chain, session=call.state.session_id
            )
        return placed.backend.stream(placed.upstream, self._memo(call, placed), self._chain(call, placed))

    async def _fitted(self, call: Call, placed: Placed, err: GatewayError) -> Placed:
        """`placed` with its `max_tokens` cut to what the server's context holds, for one more attempt;
        re-raises `err` when that cannot help (`polar.gateway.fit`)."""
        assert call.req is not None
        fit = await fit_max_tokens(placed.backend, call.req, placed.upstream, err)
        if fit is None:
            raise err
        upstream, flags = fit
        log.info("session %s call %d: %s, sent what fits", call.state.session_id, call.seq, flags[1])
        return replace(placed, upstream=upstream, flags=(*placed.flags, *flags))

    def _memo(self, call: Call, placed: Placed) -> IdsMemo | None:
        """The session's prompt-ids memo for a call to the policy (a side call's model tokenizes otherwise)."""
        return None if placed.routed else call.state.ids_memo

    def _chain(self, call: Call, placed: Placed) -> Chain | None:
        """The session's token chain for a call to the policy (`polar.gateway.render`)."""
        return None if placed.routed else call.state.chain

    async def _call_streamed(self, call: Call, placed: Placed, fmt: StreamFormat) -> Response:
        """Start the upstream stream and answer with `_relay` once its first chunk is here.

        Until then a failure (refused, unreachable, an error event) is an ordinary failed call, answered with
        the dialect's status; afterwards the harness has a 200 and failures end its stream (`_relay`)."""
        assert call.req is not None
        encoder = call.dialect.stream_encoder(call.req, self.codec, fmt)
        await self.gate.enter()
        call.policy_version = self.gate.policy_version
        t_up = time.perf_counter()
        try:
            chunks, first = await self._first_chunk(call, placed)
        except GatewayError as err:
            try:
                placed = await self._fitted(call, placed, err)
                chunks, first = await self._first_chunk(call, placed)
            except BaseException:
                self.gate.leave()
                raise
        except BaseException:
            self.gate.leave()
            raise
        flight = Flight(call, chunks, self.gate, self.sessions, self.recorder)
        media = JSON if fmt == "json-array" else "text/event-stream"
        return RelayResponse(
            relay(flight, placed, encoder, first, t_up), flight, media_type=media, headers=SSE_HEADERS
        )

    async def _first_chunk(
        self, call: Call, placed: Placed
    ) -> tuple[AsyncGenerator[StreamChunk, None], StreamChunk]:
        """Start the upstream stream; its first chunk, or its failure (the stream closed)."""
        chunks = self._stream(call, placed)
        try:
            return chunks, await anext(chunks)
        except StopAsyncIteration:
            await chunks.aclose()
            raise GatewayError(
                "upstream_error", "inference server ended the stream before any chunk"
            ) from None
        except BaseException:
            await chunks.aclose()
            raise

    async def _place(self, call: Call, req: CanonicalRequest) -> Placed:
        """The backend that serves this call, its upstream body, and the harness's tags for it: the policy,
        unless the session routes side calls and its classifier tags this one, or is an evaluator's own
        session (then the frozen model). The model a call names never chooses: only the session does."""
        route = call.state.route
        if route is None:  # only sessions that route calls pay for classification
            return Placed(self.backend, self.backend.build_body(req, self.served_model), (), ())
        if route.classify is None:  # an evaluator's session: every call
            tags: tuple[str, ...] = (route.tag,)
        else:
            upstream = self.backend.build_body(req, self.served_model)
            tags = self._side_tags(
                route.classify, call.state, call.seq, call.dialect, call.body, upstream, req
            )
            if SIDE_CALL not in tags:
                return Placed(self.backend, upstream, tags, ())
        backend = await self.side_backend(route)
        return Placed(backend, backend.build_body(req, route.model), tags, (), routed=route.flag)


if TYPE_CHECKING:  # mypy checks that the proxy is what a scrape reads and what dialect routes use
    from polar.gateway.dialects.serving import Serving

    def _watched(proxy: Proxy) -> Watched:
        return proxy

    def _serving(proxy: Proxy) -> Serving:
        return proxy
