"""A streamed answer: upstream chunks encoded in the harness's dialect as they arrive, the record committed
before the closing events, and the gate and the session's in-flight count given back exactly once however
the stream ends."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from polar.gateway.backends.stream import StreamAccumulator
from polar.gateway.call import Call, Placed
from polar.gateway.canonical import StreamChunk
from polar.gateway.dialects.base import StreamEncoder
from polar.gateway.errors import GatewayError
from polar.gateway.gate import Gate
from polar.gateway.recorder import Recorder
from polar.gateway.sessions import SessionRegistry

log = logging.getLogger("polar.gateway")


class Flight:
    """A streamed call from its first upstream chunk to its end: it holds the weight-sync gate and its
    session's in-flight count, and gives both back exactly once, however the stream ends (finished, failed,
    the harness gone mid-stream, or gone before the body even started, when `relay` never runs)."""

    def __init__(
        self,
        call: Call,
        chunks: AsyncGenerator[StreamChunk, None],
        gate: Gate,
        sessions: SessionRegistry,
        recorder: Recorder,
    ) -> None:
        self.call, self.chunks = call, chunks
        self.gate, self.sessions, self.recorder = gate, sessions, recorder
        self.started = False  # `relay` began
        self.ended = False  # recorded: committed, or its failure stored
        self._in_gate = True
        self._done = False

    def leave_gate(self) -> None:
        if self._in_gate:
            self._in_gate = False
            self.gate.leave()

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        self.leave_gate()
        if not self.ended:
            # The harness went away (or the task was cancelled): nothing more can be awaited here.
            gone = GatewayError("upstream_error", "the client closed the stream before it ended")
            self.recorder.abandon(self.call, self.chunks, gone)
        self.sessions.release(self.call.state)


class RelayResponse(StreamingResponse):
    """The streamed answer; ends its `Flight` when the response ends, even if its body never started."""

    def __init__(self, content: AsyncIterator[bytes], flight: Flight, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.flight = flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.flight.finish()


async def relay(
    flight: Flight, placed: Placed, encoder: StreamEncoder, first: StreamChunk, t_up: float
) -> AsyncIterator[bytes]:
    """The harness's stream: each upstream chunk encoded as it comes; at the end the record is committed
    and only then the closing events are sent, so a stream the harness saw finish has its record. A
    failure on the way (dropped upstream, error event, malformed chunk, the store) is recorded and ends
    the stream with the dialect's error event. A harness that goes away closes the upstream stream (the
    server aborts the generation) and leaves a failure record."""
    call, chunks, recorder = flight.call, flight.chunks, flight.recorder
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
        await recorder.commit(call, placed, comp, upstream_ms)
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
        await recorder.failure(call, err)
        yield encoder.fail(err)
    finally:
        flight.finish()
