"""A streamed answer: upstream chunks encoded in the harness's dialect as they arrive, the record committed
before the closing events, and the gate and the session's in-flight count given back exactly once however
the stream ends."""

from __future__ import annotations

import asyncio
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
    """The streamed answer; ends its `Flight` when the response ends, even if its body never started.

    Starlette's `StreamingResponse` opens an anyio task group per response under uvicorn (ASGI 2.3: a
    send to a client that hung up raises nothing), to stream in one task while another waits for the
    hang-up; that machinery cost ~0.1 ms of a ~1.2 ms stream. Here the body is sent from the request's own
    task and one plain task waits for `http.disconnect`, cancelling the sending if it comes first."""

    def __init__(self, content: AsyncIterator[bytes], flight: Flight, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.flight = flight
        self._last_sent = False  # the closing message is on its way: a disconnect now changes nothing
        self._hung_up = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(self._watch(receive, task))
        try:
            await self._send_all(send)
        except asyncio.CancelledError:
            if not self._hung_up or task.uncancel() > 0:  # cancelled from elsewhere as well
                raise
        finally:
            watcher.cancel()
            self.flight.finish()

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": body, "more_body": True})
        self._last_sent = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch(self, receive: Receive, sender: asyncio.Task[Any]) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the server's receive failing is its own business; the send will end
            return
        if not self._last_sent:
            self._hung_up = True
            sender.cancel()


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
