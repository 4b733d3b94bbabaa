"""A session's token chain: its next prompt is its last prompt, the ids sampled after it, and only the new
messages rendered (`Template.delta`), while the harness's history continues what the chain holds.

Why: a server that renders the whole conversation again at every call re-tokenizes the model's own answer
from its text (tool-call JSON re-serialized, reasoning dropped from earlier turns by Qwen3's template,
whitespace normalized), so the next prompt does not start with the ids that were sampled, and one session
falls apart into many traces with drift between them. A chain keeps the ids the model saw and wrote.

The history continues the chain when it holds the chain's messages unchanged, then an assistant message
that says what the chain's answer said (same tool calls by name and arguments, same content up to
surrounding whitespace: harnesses re-serialize and drop reasoning), then new messages. Anything else
(compaction, truncation, an edited turn, other tools or template switches) starts a new chain from a full
rendering, and the record says why (its `chain:<reason>` flag). So does a new user message where the
template puts the tool list right before the last user message (Mistral's): continued, the chain would
hold the list twice, where no rendering of the conversation has it. A session keeps a few chains at once: side
calls and subagents interleave with the main loop, and each continues its own.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from typing import Any

from polar.gateway.render.template import Template
from polar.jsontypes import JSON

# Why a call's prompt starts a new chain (the record's flag is `chain:<reason>`); a continued one has none.
FIRST = "first"  # the session's first call (or the first since the gateway forgot it)
REWRITTEN = "rewritten"  # the history does not continue the chain: compacted, truncated, edited
SETTINGS = "settings_changed"  # other tools or chat-template switches: the prompt's start changes
TOOLS_MOVED = "tools_moved"  # a user message where the template moves the tool list before the last one

# Chains a session keeps: a main loop, its side calls (titles, summaries) and subagents interleave, each
# continuing its own chain; the least recently continued one is dropped past this many.
MAX_HEADS = 4


@dataclass(slots=True, eq=False)
class Head:
    """One chain as of its last answered call: that call's prompt and sampled ids (4 bytes a token), the
    history it was sent (held by reference) and the answer it got."""

    ids: array[int]
    ended: bool  # whether the sampled ids end with the template's end-of-turn marker
    messages: list[dict[str, Any]]
    answer: dict[str, Any]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any] | None

    def breaks(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
        moves_tools: bool = False,
    ) -> str | None:
        """Why `messages` do not continue this chain; None when they do. `moves_tools`: the template puts
        the tool list before the last user message (`Template.moves_tools`)."""
        if tools != self.tools or (kwargs or None) != (self.kwargs or None):
            return SETTINGS
        n = len(self.messages)
        if len(messages) <= n + 1 or messages[:n] != self.messages or not same_turn(messages[n], self.answer):
            return REWRITTEN
        if tools and moves_tools and any(m.get("role") == "user" for m in messages[n + 1 :]):
            return TOOLS_MOVED
        return None


@dataclass(frozen=True, slots=True)
class Prompt:
    """A call's prompt ids, the text rendered for it (whether it leaves a thought open is read from its
    end), why it starts a new chain (None: it continues `head`)."""

    ids: list[int]
    rendered: str
    restart: str | None
    head: Head | None = None


@dataclass(slots=True)
class Chain:
    """One session's chains (`MAX_HEADS` at most, the most recently continued first)."""

    heads: list[Head] = field(default_factory=list)
    started: int = 0  # chains started in this session

    def prompt(
        self,
        template: Template,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
    ) -> Prompt:
        """The prompt for `messages`: a chain of the session continued, or a full rendering and why not (as
        against the most recent chain)."""
        why = FIRST
        for i, head in enumerate(
            list(self.heads)
        ):  # a copy: a worker thread may run this (`advance` does not)
            broken = head.breaks(messages, tools, kwargs, template.moves_tools)
            if broken is None:
                delta = template.delta(messages[len(head.messages) + 1 :], tools, kwargs)
                bridge = delta if head.ended else template.end_of_turn + delta
                return Prompt([*head.ids, *template.encode(bridge)], bridge, None, head)
            if i == 0:
                why = broken
        text = template.render(messages, tools, kwargs)
        return Prompt(template.encode(text), text, why)

    def advance(
        self,
        prompt: Prompt,
        sampled: list[int],
        end_id: int,
        messages: list[dict[str, Any]],
        answer: dict[str, Any],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
    ) -> None:
        """Hold the answered call: the chain it continued (or a new one) moves to the front."""
        ids = array("i", prompt.ids)
        ids.extend(sampled)
        head = Head(ids, bool(sampled) and sampled[-1] == end_id, messages, answer, tools, kwargs)
        if prompt.head is not None and prompt.head in self.heads:
            self.heads.remove(prompt.head)
        if prompt.restart is not None:
            self.started += 1
        self.heads.insert(0, head)
        del self.heads[MAX_HEADS:]


def same_turn(sent: dict[str, Any], answer: dict[str, Any]) -> bool:
    """Whether the harness's assistant message `sent` is the gateway's `answer` as harnesses send it back:
    the same tool calls (name and arguments as JSON values, ids aside) and the same content up to surrounding
    whitespace; reasoning is not compared (harnesses drop or move it)."""
    if sent.get("role") != "assistant":
        return False
    if _text(sent.get("content")).strip() != _text(answer.get("content")).strip():
        return False
    return _calls(sent) == _calls(answer)


def _text(content: JSON) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any]]:
    out = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return [("?", None)]
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append((fn.get("name"), args))
    return out
