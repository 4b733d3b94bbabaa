"""One model call, end to end: key → parse → normalize → upstream → record → answer in the caller's dialect.

This is the hot path. Its only network wait is the upstream call; the record is committed (group commit,
see `polar.store.writer`) before the harness receives its answer, so a response the harness saw always has
its record. A failure after the key was accepted is recorded as a failure, never as a completion.

A streamed call (`stream: true`, Gemini's stream route) is streamed from the backend: each upstream chunk
is encoded in the harness's dialect as it arrives (`Dialect.stream_encoder`), the chunks are added up to the
same `Completion` a whole answer gives, and the stream's closing events go out only after its record is
committed. Layers: `call` -> `_call_handling_errors` -> `_prepare`, then `_call_single` (one answer) or
`_call_streamed` -> `_relay` (a stream); both end in `_commit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from polar.gateway import toolcheck
from polar.gateway.backends import make_backend
from polar.gateway.backends.base import Backend, BackendOptions
from polar.gateway.backends.pool import BackendPool
from polar.gateway.backends.prompt_ids import IdsMemo
from polar.gateway.backends.stream import StreamAccumulator
from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk
from polar.gateway.dialects.base import Dialect, StreamEncoder, StreamFormat
from polar.gateway.errors import GatewayError, invalid
from polar.gateway.fit import fit_max_tokens
from polar.gateway.keys import session_key
from polar.gateway.metrics import AUTHENTICATION, GatewayMetrics
from polar.gateway.quirks import apply_quirks
from polar.gateway.render.chain import Chain
from polar.gateway.routing import FLAG_ROUTED, SIDE_CALL, SideRoute, provisional_record
from polar.gateway.sessions import SessionRegistry, SessionState
from polar.gateway.signatures import ReasoningCodec
from polar.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    BodyError,
    format_path,
    json_error,
    nesting_message,
    nesting_path,
    read_body,
)
from polar.metrics import BusyClock
from polar.netguard import OutboundPolicy
from polar.store.records import FLAG_NOT_TRAINABLE, CompletionRecord, FailureRecord
from polar.store.writer import AsyncWriter

log = logging.getLogger("polar.gateway")

JSON = "application/json"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
CLOSE = {"connection": "close"}


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a call goes: the backend, the exact body sent to it, the harness's tags, the quirks applied,
    and flags its record gets for what the gateway changed on the way (`polar.gateway.fit`)."""

    backend: Backend
    upstream: dict[str, Any]
    tags: tuple[str, ...]
    quirks: tuple[str, ...]
    flags: tuple[str, ...] = ()


def completion_id(seq: int) -> str:
    """The gateway's own id for a session's call `seq`: unique in the session by its seq, and across sessions
    by its random part. Inference servers' ids are not unique (a restarted server counts from the start
    again, a frozen model's server counts alike, a hosted API may send none), and a session whose records
    repeat an id could not be built into a trajectory: one such repeat turned a whole session into ERROR."""
    return f"cmpl-{secrets.token_hex(8)}-{seq}"


@dataclass
class Call:
    """One generation call on its way through the proxy's layers; a failure record needs what it got to."""

    state: SessionState
    seq: int
    dialect: Dialect
    created: float  # unix seconds at arrival
    started: float  # perf_counter at arrival
    body: Any = None
    req: CanonicalRequest | None = None
    policy_version: int | None = None  # the gate's when the call entered generation


class Flight:
    """A streamed call from its first upstream chunk to its end: it holds the weight-sync gate and its
    session's in-flight count, and gives both back exactly once, however the stream ends (finished, failed,
    the harness gone mid-stream, or gone before the body even started, when `_relay` never runs)."""

    def __init__(self, proxy: Proxy, call: Call, chunks: AsyncGenerator[StreamChunk, None]) -> None:
        self.proxy, self.call, self.chunks = proxy, call, chunks
        self.started = False  # `_relay` began
        self.ended = False  # recorded: committed, or its failure stored
        self._in_gate = True
        self._done = False

    def leave_gate(self) -> None:
        if self._in_gate:
            self._in_gate = False
            self.proxy.gate.leave()

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        self.leave_gate()
        if not self.ended:
            # The harness went away (or the task was cancelled): nothing more can be awaited here.
            gone = GatewayError("upstream_error", "the client closed the stream before it ended")
            self.proxy._spawn(self.proxy._abandon(self.call, self.chunks, gone))
        self.proxy.sessions.release(self.call.state)


class RelayResponse(StreamingResponse):
    """The streamed answer; ends its `Flight` when the response ends, even if its body never started."""

    def __init__(self, content: AsyncIterator[bytes], flight: Flight, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.flight = flight

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.finish()


def render(dialect: Dialect, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> Response:
    """A whole answer as the dialect's JSON body (streamed calls are answered by `Proxy._relay`)."""
    return Response(orjson.dumps(dialect.render(req, comp, codec)), media_type=JSON)


def failure_response(call: Call, err: GatewayError, fmt: StreamFormat) -> Response:
    """A failed call's answer: the dialect's in-stream error event when the harness asked for an SSE stream
    (Gemini's JSON-array stream is one JSON document, so its errors stay plain JSON), else its envelope."""
    if call.req is not None and call.req.stream and fmt == "sse":
        return Response(
            call.dialect.stream_error(err),
            status_code=call.dialect.stream_error_status(err),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    return error_response(call.dialect, err)


def error_response(dialect: Dialect, err: GatewayError) -> Response:
    status, body = dialect.error(err)
    # A body that did not arrive in time leaves the connection mid-request: whatever the client sends next
    # would be read as the rest of it, so the connection is closed with the answer.
    headers = CLOSE if err.status == 408 else None
    return Response(orjson.dumps(body), status_code=status, media_type=JSON, headers=headers)


async def read_json(request: Request, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> Any:
    """The request body as JSON: at most `limit` bytes, read within `timeout_s`, nested at most
    `MAX_JSON_DEPTH` deep (so that whatever is accepted can be stored)."""
    body = parse_json(await read_raw(request, limit, timeout_s))
    check_nesting(body)
    return body


async def read_raw(request: Request, limit: int, timeout_s: float) -> bytes:
    try:
        return await read_body(request, limit, timeout_s)
    except BodyError as exc:
        if exc.status == 413:
            raise GatewayError("request_too_large", exc.message) from None
        raise GatewayError("invalid_request", exc.message, status=exc.status) from None


def parse_json(raw: bytes) -> Any:
    if not raw:
        raise invalid("request body is empty; expected a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(json_error(exc)) from None


def check_nesting(body: Any) -> None:
    """Refuse a body nested deeper than `MAX_JSON_DEPTH`, naming where, before any generation for it."""
    path = nesting_path(body)
    if path is not None:
        raise invalid(nesting_message(path), format_path(path))


def request_summary(body: Any, reason: str) -> dict[str, Any]:
    """What a failure record keeps of a body it cannot store whole: why, and the top-level keys."""
    keys = [str(k)[:64] for k in list(body)[:64]] if isinstance(body, dict) else []
    return {"polar_unstored_body": {"reason": reason[:512], "keys": keys}}


class Gate:
    """Pauses new generations and drains in-flight ones while a trainer swaps the policy's weights."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.clock = BusyClock()  # calls in flight, and the seconds there was one (polar.gateway.metrics)
        self._idle = asyncio.Event()
        self._idle.set()
        # The weights the server generates with, as the trainer said when it resumed the gate; stamped on
        # records whose server reports no version (vLLM does not).
        self.policy_version: int | None = None

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @property
    def in_flight(self) -> int:
        return self.clock.in_flight

    async def enter(self) -> None:
        await self._open.wait()
        self.clock.enter()
        self._idle.clear()

    def leave(self) -> None:
        self.clock.leave()
        if self.clock.in_flight == 0:
            self._idle.set()

    async def pause(self, drain_timeout_s: float | None = None) -> bool:
        """Stop admitting calls; True once every call in flight has finished (False on timeout)."""
        self._open.clear()
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def resume(self, policy_version: int | None = None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        self._open.set()


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
        # Clean-ups of streams whose harness went away, run outside the cancelled request.
        self._tasks: set[asyncio.Task[None]] = set()

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
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        backends, self._side_backends = list(self._side_backends.values()), {}
        for backend in backends:
            await backend.aclose()

    @staticmethod
    def _side_tags(
        route: SideRoute,
        state: SessionState,
        seq: int,
        dialect: Dialect,
        body: Any,
        upstream: dict[str, Any],
        req: CanonicalRequest,
    ) -> tuple[str, ...]:
        try:
            return tuple(
                route.classify(provisional_record(state.session_id, seq, dialect.name, body, upstream, req))
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
            await self._record_failure(call.state, call.seq, call.dialect, call.created, call.body, err)
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
        backend, upstream, tags = await self._place(call, req)
        return Placed(backend, upstream, tags, quirks)

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
        await self._commit(call, placed, comp, upstream_ms)
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
        return call.state.ids_memo if placed.backend is self.backend else None

    def _chain(self, call: Call, placed: Placed) -> Chain | None:
        """The session's token chain for a call to the policy (`polar.gateway.render`)."""
        return call.state.chain if placed.backend is self.backend else None

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
        flight = Flight(self, call, chunks)
        relay = self._relay(call, placed, encoder, chunks, first, t_up, flight)
        media = JSON if fmt == "json-array" else "text/event-stream"
        return RelayResponse(relay, flight, media_type=media, headers=SSE_HEADERS)

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

    async def _relay(
        self,
        call: Call,
        placed: Placed,
        encoder: StreamEncoder,
        chunks: AsyncGenerator[StreamChunk, None],
        first: StreamChunk,
        t_up: float,
        flight: Flight,
    ) -> AsyncIterator[bytes]:
        """The harness's stream: each upstream chunk encoded as it comes; at the end the record is committed
        and only then the closing events are sent, so a stream the harness saw finish has its record. A
        failure on the way (dropped upstream, error event, malformed chunk, the store) is recorded and ends
        the stream with the dialect's error event. A harness that goes away closes the upstream stream (the
        server aborts the generation) and leaves a failure record."""
        acc = StreamAccumulator()
        flight.started = True
        try:
            acc.add(first)
            out = encoder.open(acc.head()) + encoder.delta(first)
            if out:
                yield out
            async for chunk in chunks:
                acc.add(chunk)
                out = encoder.delta(chunk)
                if out:
                    yield out
            upstream_ms = (time.perf_counter() - t_up) * 1000.0
            flight.leave_gate()
            comp = acc.completion()
            await self._commit(call, placed, comp, upstream_ms)
            flight.ended = True
            yield encoder.close(comp)
        except Exception as exc:
            flight.ended = True
            flight.leave_gate()
            if isinstance(exc, GatewayError):
                err = exc
            else:  # a bug here must still end the harness's stream in its grammar, and be recorded
                log.exception("stream of session %s call %d failed", call.state.session_id, call.seq)
                err = GatewayError("upstream_error", "internal gateway error; the call was not completed")
            await chunks.aclose()
            await self._record_failure(call.state, call.seq, call.dialect, call.created, call.body, err)
            yield encoder.fail(err)
        finally:
            flight.finish()

    async def _abandon(
        self, call: Call, chunks: AsyncGenerator[StreamChunk, None], err: GatewayError
    ) -> None:
        with contextlib.suppress(Exception):
            await chunks.aclose()
        await self._record_failure(call.state, call.seq, call.dialect, call.created, call.body, err)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _commit(self, call: Call, placed: Placed, comp: Completion, upstream_ms: float) -> None:
        """Record `comp` (committed to the store) and remember its tool calls; `overloaded` if it cannot be."""
        assert call.req is not None
        req, backend, tags = call.req, placed.backend, placed.tags
        overhead_ms = (time.perf_counter() - call.started) * 1000.0 - upstream_ms
        state, seq = call.state, call.seq
        record = self._record(
            state, seq, call.dialect, call.created, call.body, placed.upstream, req, comp, placed.quirks
        )
        record = replace(
            record, upstream_latency_ms=round(upstream_ms, 3), gateway_overhead_ms=round(overhead_ms, 3)
        )
        if placed.flags:
            record = replace(record, flags=(*record.flags, *placed.flags))
        if record.policy_version is None and backend is self.backend:
            record = replace(record, policy_version=call.policy_version)
        if backend is not self.backend:
            # The frozen model's tokens are never the policy's, whatever its server returned.
            flags = tuple(dict.fromkeys((*record.flags, FLAG_NOT_TRAINABLE, FLAG_ROUTED)))
            record = replace(record, flags=flags, tags=tags)
        elif tags:
            record = replace(record, tags=tags)
        t_commit = time.perf_counter()
        try:
            # Alone: no other generation in flight, so no commit to share (see AsyncWriter.write).
            await self.writer.write(lambda w: w.add_completion(record), alone=self.gate.in_flight == 0)
        except Exception:
            # Never hand out a response whose record did not land: the harness retries instead.
            log.exception("could not record session %s call %d", state.session_id, seq)
            raise GatewayError("overloaded", "the gateway could not record this call; retry") from None
        commit_s = time.perf_counter() - t_commit
        self.metrics.committed(
            comp.prompt_tokens, comp.completion_tokens, upstream_ms / 1000.0, commit_s, overhead_ms / 1000.0
        )
        state.counts["completions"] += 1
        state.tool_arguments.remember(comp.tool_calls, comp.content)

    async def _place(
        self, call: Call, req: CanonicalRequest
    ) -> tuple[Backend, dict[str, Any], tuple[str, ...]]:
        """The backend that serves this call, its upstream body, and the harness's tags for it: the policy,
        unless the session routes side calls and its classifier tags this one (then the frozen model)."""
        upstream = self.backend.build_body(req, self.served_model)
        route = call.state.route
        if route is None:  # only sessions that route side calls pay for classification
            return self.backend, upstream, ()
        tags = self._side_tags(route, call.state, call.seq, call.dialect, call.body, upstream, req)
        if SIDE_CALL not in tags:
            return self.backend, upstream, tags
        backend = await self.side_backend(route)
        return backend, backend.build_body(req, route.model), tags

    def _record(
        self,
        state: SessionState,
        seq: int,
        dialect: Dialect,
        created: float,
        body: Any,
        upstream: dict[str, Any],
        req: CanonicalRequest,
        comp: Completion,
        quirks: tuple[str, ...],
    ) -> CompletionRecord:
        return CompletionRecord(
            session_id=state.session_id,
            seq=seq,
            completion_id=completion_id(seq),
            upstream_id=comp.id,
            dialect=dialect.name,
            created_at=created,
            request=body,
            upstream_request=upstream,
            prompt_ids=comp.prompt_ids,
            response_ids=comp.response_ids,
            response_logprobs=comp.response_logprobs,
            finish_reason=comp.finish_reason,
            response_message=comp.message(),
            tools=req.tools,
            usage={"prompt_tokens": comp.prompt_tokens, "completion_tokens": comp.completion_tokens},
            model_requested=req.model,
            model_served=comp.model,
            policy_version=comp.policy_version,
            flags=tuple(dict.fromkeys((*comp.flags, *toolcheck.flags(req, comp))))
            + tuple(f"quirk:{q}" for q in quirks),
        )

    async def _record_failure(
        self, state: SessionState, seq: int, dialect: Dialect, created: float, body: Any, err: GatewayError
    ) -> None:
        """Store the failure; a body that cannot be stored (refused for its nesting, or refused by the store)
        is replaced by a summary, so the failure itself is never lost."""
        request: dict[str, Any] | None = None
        if isinstance(body, dict):
            deep = nesting_path(body)
            request = body if deep is None else request_summary(body, nesting_message(deep))
        failure = FailureRecord(
            session_id=state.session_id,
            seq=seq,
            dialect=dialect.name,
            created_at=created,
            status=err.status,
            kind=err.kind,
            message=err.message,
            request=request,
        )
        state.counts["failures"] += 1
        self.metrics.failure(dialect.name, err.kind)
        try:
            await self.writer.write(lambda w: w.add_failure(failure))
            return
        except Exception as exc:
            if failure.request is None:  # the store itself failed: the caller still gets its error
                log.exception("could not record failure of session %s call %d", state.session_id, seq)
                return
            summary = replace(failure, request=request_summary(body, f"the store refused it: {exc}"))
        try:
            await self.writer.write(lambda w: w.add_failure(summary))
        except Exception:
            log.exception("could not record failure of session %s call %d", state.session_id, seq)
