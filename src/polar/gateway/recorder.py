"""A call's record: built once from the call, where it went and what came back, and committed before the
harness gets its answer (group commit, `polar.store.writer`). A failure after the key was accepted is stored
as a failure record, never as a completion, and is never lost for a body the store cannot hold."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import replace
from typing import Any

from polar.gateway import toolcheck
from polar.gateway.call import Call, Placed, completion_id
from polar.gateway.canonical import Completion, StreamChunk
from polar.gateway.errors import GatewayError
from polar.gateway.gate import Gate
from polar.gateway.metrics import GatewayMetrics
from polar.limits import nesting_message, nesting_path
from polar.store.records import FLAG_NOT_TRAINABLE, CompletionRecord, FailureRecord
from polar.store.writer import AsyncWriter, completion

log = logging.getLogger("polar.gateway")


def request_summary(body: Any, reason: str) -> dict[str, Any]:
    """What a failure record keeps of a body it cannot store whole: why, and the top-level keys."""
    keys = [str(k)[:64] for k in list(body)[:64]] if isinstance(body, dict) else []
    return {"polar_unstored_body": {"reason": reason[:512], "keys": keys}}


def completion_record(call: Call, placed: Placed, comp: Completion, upstream_ms: float) -> CompletionRecord:
    """The record of a completed call. A call routed to a frozen model (side call, judge) is never trainable,
    whatever its server returned; a policy call whose server reports no weights version gets the gate's."""
    req = call.req
    assert req is not None
    flags = (
        *dict.fromkeys((*comp.flags, *toolcheck.flags(req, comp))),
        *(f"quirk:{q}" for q in placed.quirks),
        *placed.flags,
    )
    policy_version = comp.policy_version
    if placed.routed:
        flags = tuple(dict.fromkeys((*flags, FLAG_NOT_TRAINABLE, placed.routed)))
    elif policy_version is None:
        policy_version = call.policy_version
    overhead_ms = (time.perf_counter() - call.started) * 1000.0 - upstream_ms
    return CompletionRecord(
        session_id=call.state.session_id,
        seq=call.seq,
        completion_id=completion_id(call.seq),
        upstream_id=comp.id,
        dialect=call.dialect.name,
        created_at=call.created,
        request=call.body,
        upstream_request=placed.upstream,
        prompt_ids=comp.prompt_ids,
        response_ids=comp.response_ids,
        response_logprobs=comp.response_logprobs,
        finish_reason=comp.finish_reason,
        response_message=comp.message(),
        tools=req.tools,
        usage={"prompt_tokens": comp.prompt_tokens, "completion_tokens": comp.completion_tokens},
        model_requested=req.model,
        model_served=comp.model,
        policy_version=policy_version,
        upstream_latency_ms=round(upstream_ms, 3),
        gateway_overhead_ms=round(overhead_ms, 3),
        flags=tuple(flags),
        tags=placed.tags,
    )


class Recorder:
    """Commits the records of one gateway's calls and counts them (`polar.gateway.metrics`)."""

    def __init__(self, writer: AsyncWriter, metrics: GatewayMetrics, gate: Gate) -> None:
        self.writer, self.metrics, self.gate = writer, metrics, gate
        # Clean-ups of streams whose harness went away, run outside the cancelled request.
        self._tasks: set[asyncio.Task[None]] = set()

    async def commit(self, call: Call, placed: Placed, comp: Completion, upstream_ms: float) -> None:
        """Record `comp` (committed to the store) and remember its tool calls; `overloaded` if it cannot be."""
        record = completion_record(call, placed, comp, upstream_ms)
        t_commit = time.perf_counter()
        try:
            # Alone: no other generation in flight, so no commit to share (see AsyncWriter.write).
            await self.writer.write(completion(record), alone=self.gate.in_flight == 0)
        except Exception:
            # Never hand out a response whose record did not land: the harness retries instead.
            log.exception("could not record session %s call %d", call.state.session_id, call.seq)
            raise GatewayError("overloaded", "the gateway could not record this call; retry") from None
        commit_s = time.perf_counter() - t_commit
        self.metrics.committed(
            comp.prompt_tokens,
            comp.completion_tokens,
            upstream_ms / 1000.0,
            commit_s,
            record.gateway_overhead_ms / 1000.0,
        )
        call.state.counts["completions"] += 1
        call.state.tool_arguments.remember(comp.tool_calls, comp.content)

    async def failure(self, call: Call, err: GatewayError) -> None:
        """Store the failure; a body that cannot be stored (refused for its nesting, or refused by the store)
        is replaced by a summary, so the failure itself is never lost."""
        state, body = call.state, call.body
        request: dict[str, Any] | None = None
        if isinstance(body, dict):
            deep = nesting_path(body)
            request = body if deep is None else request_summary(body, nesting_message(deep))
        failure = FailureRecord(
            session_id=state.session_id,
            seq=call.seq,
            dialect=call.dialect.name,
            created_at=call.created,
            status=err.status,
            kind=err.kind,
            message=err.message,
            request=request,
        )
        state.counts["failures"] += 1
        self.metrics.failure(call.dialect.name, err.kind)
        try:
            await self.writer.write(lambda w: w.add_failure(failure))
            return
        except Exception as exc:
            if failure.request is None:  # the store itself failed: the caller still gets its error
                log.exception("could not record failure of session %s call %d", state.session_id, call.seq)
                return
            summary = replace(failure, request=request_summary(body, f"the store refused it: {exc}"))
        try:
            await self.writer.write(lambda w: w.add_failure(summary))
        except Exception:
            log.exception("could not record failure of session %s call %d", state.session_id, call.seq)

    def abandon(self, call: Call, chunks: AsyncGenerator[StreamChunk, None], err: GatewayError) -> None:
        """Close a stream whose harness went away and record its failure, in a task of its own: the request
        that held it is being cancelled, so nothing can be awaited there."""
        self._spawn(self._abandon(call, chunks, err))

    async def _abandon(
        self, call: Call, chunks: AsyncGenerator[StreamChunk, None], err: GatewayError
    ) -> None:
        with contextlib.suppress(Exception):
            await chunks.aclose()
        await self.failure(call, err)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Finish the clean-ups of abandoned streams."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
