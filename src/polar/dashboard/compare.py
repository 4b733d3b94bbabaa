"""Sessions side by side: why did one sample of a task get reward 1 and another 0?

Each session is shown by one conversation: its longest trace's messages (the whole chain when traces are
prefix-merged; the last call's full history when they are per request). The conversations are aligned
message by message and the first message where they stop agreeing is the divergence point: everything
before it is the same in every session (the shared prompt), so what follows is where the samples went
different ways. Messages are compared by role, text, reasoning and tool calls, not by tool-call ids (a
harness gives each call a fresh random id, which says nothing about what the policy did).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polar.dashboard.queries import SessionDetail
from polar.dashboard.views import STAGES, Message, conversation, pretty, text_diff

MIN_SESSIONS, MAX_SESSIONS = 2, 6


def main_trace(traces: list[dict[str, Any]]) -> int | None:
    """The index of the trace with the most messages (the last of equals), or None without traces."""
    if not traces:
        return None
    sizes = [len(t.get("prompt_messages") or []) + len(t.get("response_messages") or []) for t in traces]
    return max(range(len(traces)), key=lambda i: (sizes[i], i))


def _key(m: Message) -> tuple[str, str, str, tuple[tuple[str, str], ...]]:
    return (m.role, m.text, m.reasoning, tuple(m.tool_calls))


def first_divergence(convs: list[list[Message]]) -> int | None:
    """The first message index where the conversations differ (one ending counts as differing), or None
    when all are the same."""
    longest = max((len(c) for c in convs), default=0)
    for i in range(longest):
        keys = {_key(c[i]) if i < len(c) else None for c in convs}
        if len(keys) > 1:
            return i
    return None


@dataclass(frozen=True)
class Row:
    index: int
    cells: list[Message | None]  # one per session; None where that conversation has ended
    same: bool


def align(convs: list[list[Message]]) -> list[Row]:
    longest = max((len(c) for c in convs), default=0)
    rows = []
    for i in range(longest):
        cells = [c[i] if i < len(c) else None for c in convs]
        keys = {_key(m) if m is not None else None for m in cells}
        rows.append(Row(i, cells, len(keys) == 1))
    return rows


def final_answer(conv: list[Message]) -> str:
    """The last assistant message as text: its content, then each tool call as `name(arguments)`."""
    for m in reversed(conv):
        if m.role == "assistant":
            return "\n".join([m.text, *(f"{name}({args})" for name, args in m.tool_calls)]).strip()
    return ""


def tool_calls(conv: list[Message]) -> str:
    """Every tool call of the conversation, one per line, in order."""
    return "\n".join(f"{name}({args})" for m in conv for name, args in m.tool_calls)


@dataclass(frozen=True)
class Side:
    """One session's column."""

    detail: SessionDetail
    traces: list[dict[str, Any]]
    trace: int | None  # which trace's conversation is shown
    conversation: list[Message]
    counts: dict[str, int]
    evaluation: Any

    @property
    def sid(self) -> str:
        return self.detail.summary.session_id


def side(detail: SessionDetail, trajectory: dict[str, Any] | None) -> Side:
    traces = list((trajectory or {}).get("traces") or [])
    k = main_trace(traces)
    counts = {
        "traces": len(traces),
        "calls": sum(len((t.get("metadata") or {}).get("completion_ids") or []) for t in traces),
        "prompt tokens": sum(len(t.get("prompt_ids") or []) for t in traces),
        "response tokens": sum(len(t.get("response_ids") or []) for t in traces),
        "trainable tokens": sum(sum(t.get("loss_mask") or []) for t in traces),
    }
    evaluation = ((detail.result or {}).get("metadata") or {}).get("evaluation")
    conv = conversation(traces[k]) if k is not None else []
    return Side(detail, traces, k, conv, counts, evaluation)


@dataclass(frozen=True)
class Comparison:
    sides: list[Side]
    rows: list[Row]
    divergence: int | None
    stages: list[tuple[str, list[float | None], list[float]]]  # label, seconds per side, bar % per side
    totals: list[float | None]
    answer_diffs: list[tuple[str, list[tuple[str, str]]]]  # (other session, diff of session 1 against it)
    call_diffs: list[tuple[str, list[tuple[str, str]]]]

    @property
    def evaluations(self) -> list[str]:
        return [pretty(s.evaluation) if s.evaluation is not None else "" for s in self.sides]


def compare(sides: list[Side]) -> Comparison:
    convs = [s.conversation for s in sides]
    timings = [s.detail.timings for s in sides]
    scale = max((t.get("total_s") or 0.0 for t in timings), default=0.0) or 1.0
    stages = []
    for key, label in STAGES:
        secs = [t.get(key) for t in timings]
        if any(v is not None for v in secs):
            stages.append((label, secs, [round(100 * (v or 0.0) / scale, 2) for v in secs]))
    first, rest = sides[0], sides[1:]
    answer_diffs, call_diffs = [], []
    for other in rest:
        a, b = first.sid, other.sid
        answer_diffs.append(
            (b, text_diff(final_answer(first.conversation), final_answer(other.conversation), a, b))
        )
        call_diffs.append(
            (b, text_diff(tool_calls(first.conversation), tool_calls(other.conversation), a, b))
        )
    return Comparison(
        sides=sides,
        rows=align(convs),
        divergence=first_divergence(convs),
        stages=stages,
        totals=[t.get("total_s") for t in timings],
        answer_diffs=answer_diffs,
        call_diffs=call_diffs,
    )
