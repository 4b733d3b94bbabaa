"""Shaping data for the session page's tabs: the stage timeline, messages as a conversation, and the
harness's request against what went upstream, as a diff."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import orjson

from polar.jsontypes import JSON
from polar.task import Task

# (timings key, label) in stage order: what `polar.rollout.node.session.Session.timings` reports.
STAGES = [
    ("queued_s", "queue"),
    ("init_s", "init"),
    ("ready_wait_s", "ready wait"),
    ("run_s", "run"),
    ("post_s", "postrun"),
]


@dataclass(frozen=True)
class Bar:
    label: str
    seconds: float
    start_pct: float
    width_pct: float


def timeline(timings: dict[str, float]) -> list[Bar]:
    """One bar per stage the session reached, placed on a shared axis of its total time."""
    total = timings.get("total_s") or sum(timings.get(k, 0.0) for k, _ in STAGES) or 0.0
    bars, at = [], 0.0
    for key, label in STAGES:
        if key not in timings:
            continue
        s = float(timings[key])
        start = 100 * at / total if total else 0.0
        width = 100 * s / total if total else 0.0
        bars.append(Bar(label, s, round(start, 3), round(max(width, 0.3), 3)))
        at += s
    return bars


def pretty(value: JSON) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()


def diff_lines(before: JSON, after: JSON) -> list[tuple[str, str]]:
    """A unified diff of two JSON bodies as (css class, line): "add", "del", "hunk" or "" (context)."""
    return text_diff(pretty(before), pretty(after), "harness request", "upstream request")


def text_diff(before: str, after: str, name_a: str, name_b: str) -> list[tuple[str, str]]:
    """A unified diff of two texts as (css class, line); empty when they are equal."""
    out = []
    a, b = before.splitlines(), after.splitlines()
    for line in difflib.unified_diff(a, b, name_a, name_b, n=3, lineterm=""):
        if line.startswith(("+++", "---")):
            cls = "file"
        elif line.startswith("@@"):
            cls = "hunk"
        elif line.startswith("+"):
            cls = "add"
        elif line.startswith("-"):
            cls = "del"
        else:
            cls = ""
        out.append((cls, line))
    return out


@dataclass(frozen=True)
class Message:
    """One message, flattened for the template: text parts, reasoning, tool calls, or a tool's result."""

    role: str
    text: str
    reasoning: str
    tool_calls: list[tuple[str, str]]  # (function name, arguments as text)
    tool_call_id: str | None


def _text(content: JSON) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                parts.append(str(part.get("text") or part.get("content") or f"[{part.get('type', 'part')}]"))
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return pretty(content)


def message(m: dict[str, Any]) -> Message:
    calls = []
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        calls.append((str(fn.get("name", "?")), args if isinstance(args, str) else pretty(args)))
    reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
    return Message(
        role=str(m.get("role", "?")),
        text=_text(m.get("content")),
        reasoning=reasoning if isinstance(reasoning, str) else pretty(reasoning),
        tool_calls=calls,
        tool_call_id=m.get("tool_call_id"),
    )


def conversation(trace: dict[str, Any]) -> list[Message]:
    """A trace's messages in order: the first call's prompt, then everything after it."""
    msgs = list(trace.get("prompt_messages") or []) + list(trace.get("response_messages") or [])
    return [message(m) for m in msgs if isinstance(m, dict)]


@dataclass(frozen=True)
class JudgeSession:
    """A judge session an evaluation names (`details.judge`), and its records once fetched."""

    session_id: str
    cached: bool  # the verdict came from the cache: the session judged an identical outcome earlier
    records: list[dict[str, Any]]


def judge_sessions(evaluation: JSON) -> list[tuple[str, bool, str | None]]:
    """(judge session id, cached, the node it is on when not the judged session's) of every judgement in
    an evaluation's details, combined ones included (`{"judge": {"session_id": ...}}` at any depth), in
    order, each once. A group's judgements (`judge_group`) name the node that judged the group."""
    found: dict[str, tuple[bool, str | None]] = {}

    def walk(value: JSON) -> None:
        if isinstance(value, dict):
            judge = value.get("judge")
            if isinstance(judge, dict) and isinstance(judge.get("session_id"), str):
                node = judge.get("node_id")
                found.setdefault(
                    judge["session_id"], (bool(judge.get("cached")), node if isinstance(node, str) else None)
                )
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(evaluation)
    return [(sid, cached, node) for sid, (cached, node) in found.items()]


def evaluator_label(task: Task) -> str:
    """What scores the task, in a few words: its strategy, or its evaluators and how they combine."""
    if not task.evaluators:
        return task.evaluator.strategy
    how = task.reward.combine if task.reward is not None else "sum"
    return f"{how}({', '.join(f'{name}: {ev.strategy}' for name, ev in task.evaluators.items())})"
