"""`audit(trajectory, records)`: prove a trajectory against the records it was built from.

Checked for every trace, through its `completion_ids` / `turn_offsets` metadata, on packed tokens:
- lengths align (mask, logprobs, offsets) and the mask is 0/1;
- the prompt is the first call's server prompt; each turn's tokens are exactly the ids that call's
  server sampled; trainable ones carry exactly the server's logprobs (bit for bit), masked ones 0.0;
- no token carries loss unless it is a sampled token of a trainable call;
- every interstitial is masked and is the tail of the next call's server prompt;
- at each boundary, the call's server prompt is the previous call's prompt ‖ its sampled tokens ‖ the
  interstitial, so prompt ‖ response-so-far is exactly the context the policy saw, unless the trace
  declares the turn in `drift_turns` (`on_drift="merge"`) and the re-rendering really differs there;
- every trainable sampled token appears, trainable, in exactly one trace: coverage is exactly 1.0.
It also reports context drift: boundaries where the server's re-rendering of a sampled turn in the next
prompt differs from the sampled tokens, whether the build merged across them or split there.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from polar.store.records import CompletionRecord
from polar.trajectory.calls import Call, prepare
from polar.trajectory.chains import boundary
from polar.trajectory.models import Trace, Trajectory
from polar.trajectory.tokens import ITEM, lcp, pack


class DriftTurn(BaseModel):
    model_config = ConfigDict(frozen=True)

    completion_id: str  # the call whose sampled turn was re-rendered differently
    next_completion_id: str  # the call whose prompt holds the re-rendering
    merged: bool  # True when a trace shows the sampled turn as the next call's context anyway
    diverges_at: int  # tokens into the sampled turn where the re-rendering first differs
    sampled_tokens: int
    rendered_tokens: int | None  # the re-rendered turn up to its end-of-turn token; None if not found


class AuditReport(BaseModel):
    ok: bool
    errors: list[str]
    traces: int
    turns: int
    exact_turns: int  # turns whose context in the trace is exactly the server's prompt
    sampled_tokens: int
    trainable_tokens: int
    coverage: float
    drift: list[DriftTurn]


def _floats(values: Sequence[float]) -> bytes:
    return array("d", values).tobytes()  # bitwise: a NaN logprob must equal itself


def _drift(prev: Call, nxt: Call, eot: int | None, merged: bool) -> DriftTurn | None:
    if not nxt.prompt.startswith(prev.prompt):
        return None
    cut, drift = boundary(prev, nxt, eot)
    if not drift:
        return None
    return DriftTurn(
        completion_id=prev.record.completion_id,
        next_completion_id=nxt.record.completion_id,
        merged=merged,
        diverges_at=lcp(nxt.prompt[len(prev.prompt) :], prev.sampled),
        sampled_tokens=prev.n_sampled,
        rendered_tokens=None if cut is None else cut - prev.n_prompt,
    )


class _Auditor:
    def __init__(self, trajectory: Trajectory, records: Sequence[CompletionRecord]) -> None:
        options = trajectory.metadata.get("options") or {}
        self.prepared = prepare(
            records,
            bool(options.get("train_without_logprobs", False)),
            str(options.get("dead_branches") or "train"),
        )
        self.calls = {c.record.completion_id: c for c in self.prepared.calls}
        self.eot = trajectory.metadata.get("eot_id")
        self.errors: list[str] = []
        self.drift: list[DriftTurn] = []
        self.trained: Counter[str] = Counter()  # completion id -> traces where its tokens carry loss
        self.turns = self.exact = self.trainable_tokens = 0

    def fail(self, where: str, what: str) -> None:
        self.errors.append(f"{where}: {what}")

    def trace(self, i: int, t: Trace) -> None:
        where = f"trace {i}"
        n = len(t.response_ids)
        if len(t.loss_mask) != n or (t.response_logprobs is not None and len(t.response_logprobs) != n):
            return self.fail(where, "loss_mask / response_logprobs do not align with response_ids")
        if not set(t.loss_mask) <= {0, 1}:
            return self.fail(where, "loss_mask holds values other than 0 and 1")
        self.trainable_tokens += sum(t.loss_mask)
        cids, offsets = t.metadata.get("completion_ids"), t.metadata.get("turn_offsets")
        if (
            not isinstance(cids, list)
            or not isinstance(offsets, list)
            or not cids
            or len(cids) != len(offsets)
        ):
            return self.fail(where, "metadata lacks aligned completion_ids / turn_offsets")
        unknown = [c for c in cids if c not in self.calls]
        if unknown:
            return self.fail(where, f"names calls with no usable record: {unknown}")
        prompt, response = pack(t.prompt_ids), pack(t.response_ids)
        if prompt is None or response is None:
            return self.fail(where, "holds values that are not token ids")
        turns = [self.calls[c] for c in cids]
        if prompt != turns[0].prompt:
            self.fail(where, f"prompt_ids differ from the server prompt of {cids[0]}")
        declared = set(t.metadata.get("drift_turns") or ())
        logprobs = t.response_logprobs
        if logprobs is None and not any(c.trainable and c.record.response_logprobs is None for c in turns):
            self.fail(where, "response_logprobs is None although every trainable token has a logprob")
        pos = 0
        drifted = False  # a declared drift earlier in the trace: later contexts inherit it
        for k, (call, off) in enumerate(zip(turns, offsets, strict=True)):
            self.turns += 1
            at = f"{where} turn {k} ({call.record.completion_id})"
            if not isinstance(off, int) or not pos <= off <= n:
                return self.fail(at, f"turn offset {off!r} out of order")
            if k:
                prev, interstitial = turns[k - 1], response[pos * ITEM : off * ITEM]
                if any(t.loss_mask[pos:off]):
                    self.fail(at, "interstitial tokens carry loss")
                if logprobs is not None and any(logprobs[pos:off]):
                    self.fail(at, "interstitial tokens have non-zero logprobs")
                if not call.prompt.endswith(interstitial):
                    self.fail(at, "interstitial is not the tail of the server prompt")
                if call.prompt != prev.prompt + prev.sampled + interstitial:
                    d = _drift(prev, call, self.eot, merged=True)
                    if k in declared and d is not None:
                        self.drift.append(d)
                        drifted = True
                    else:
                        self.fail(at, "context differs from the prompt the server saw")
            if not drifted and prompt + response[: off * ITEM] == call.prompt:
                self.exact += 1
            end = off + call.n_sampled
            if response[off * ITEM : end * ITEM] != call.sampled:
                return self.fail(at, "tokens differ from what the server sampled")
            self._turn_loss(at, t, call, off, end)
            pos = end
        if pos != n:
            self.fail(where, f"{n - pos} response tokens after the last turn")
        split_from = t.metadata.get("split_from")
        if split_from in self.calls:
            d = _drift(self.calls[split_from], turns[0], self.eot, merged=False)
            if d is not None:
                self.drift.append(d)

    def _turn_loss(self, at: str, t: Trace, call: Call, off: int, end: int) -> None:
        mask = t.loss_mask[off:end]
        logprobs = t.response_logprobs
        if not call.trainable:
            if any(mask):
                self.fail(at, "tokens of an untrainable call carry loss")
            if logprobs is not None and any(logprobs[off:end]):
                self.fail(at, "masked sampled tokens have non-zero logprobs")
            return
        if end == off:
            self.trained[call.record.completion_id] += 1
            return
        if sum(mask) != end - off:
            self.fail(at, "sampled tokens of a trainable call are masked")
            return
        self.trained[call.record.completion_id] += 1
        server = call.record.response_logprobs
        if logprobs is None:
            pass  # allowed only when some turn of the trace lacks logprobs (checked per trace)
        elif server is None:
            self.fail(at, "trace invents logprobs the server did not return")
        elif _floats(logprobs[off:end]) != _floats(server):
            self.fail(at, "logprobs differ from what the server returned")

    def report(self, trajectory: Trajectory) -> AuditReport:
        for call in self.prepared.calls:
            if call.trainable:
                times = self.trained[call.record.completion_id]
                if times != 1:
                    what = "missing from every trace" if times == 0 else f"trained in {times} traces"
                    self.fail(f"call {call.record.completion_id}", f"sampled tokens {what}")
        sampled = self.prepared.sampled_tokens
        coverage = self.trainable_tokens / sampled if sampled else (1.0 if not self.trainable_tokens else 0.0)
        return AuditReport(
            ok=not self.errors and coverage == 1.0,
            errors=self.errors,
            traces=len(trajectory.traces),
            turns=self.turns,
            exact_turns=self.exact,
            sampled_tokens=sampled,
            trainable_tokens=self.trainable_tokens,
            coverage=coverage,
            drift=self.drift,
        )


def audit(trajectory: Trajectory, records: Sequence[CompletionRecord]) -> AuditReport:
    """Prove `trajectory` against `records` (see module doc); `ok` is False on any violation."""
    auditor = _Auditor(trajectory, records)
    for i, t in enumerate(trajectory.traces):
        auditor.trace(i, t)
    return auditor.report(trajectory)
