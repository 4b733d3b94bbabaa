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
rendering, and the record says why (`chain:` flags, `polar.store.records`).
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from typing import Any

from polar.gateway.render.template import Template

# Why a call's prompt starts a new chain (the record's flag is `chain:<reason>`); a continued one has none.
FIRST = "first"  # the session's first call (or the first since the gateway forgot it)
REWRITTEN = "rewritten"  # the history does not continue the chain: compacted, truncated, edited
SETTINGS = "settings_changed"  # other tools or chat-template switches: the prompt's start changes
NO_ANSWER = "no_answer"  # the chain's last call has no sampled ids to continue from


@dataclass(frozen=True, slots=True)
class Prompt:
    """A call's prompt ids, the text rendered for it (whether it leaves a thought open is read from its
    end), and why it starts a new chain (None: it continues the session's chain)."""

    ids: list[int]
    rendered: str
    restart: str | None


@dataclass(slots=True)
class Chain:
    """One session's chain, as of its last answered call (`advance`). 4 bytes a token, plus the messages
    the harness sent (held by reference)."""

    ids: array[int] = field(default_factory=lambda: array("i"))  # that call's prompt and sampled ids
    ended: bool = False  # whether the sampled ids end with the template's end-of-turn marker
    messages: list[dict[str, Any]] = field(default_factory=list)  # the history that call was sent
    answer: dict[str, Any] | None = None  # the answer it got (None: no chain yet)
    tools: list[dict[str, Any]] | None = None
    kwargs: dict[str, Any] | None = None
    started: int = 0  # chains started in this session

    def prompt(
        self,
        template: Template,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
    ) -> Prompt:
        """The prompt for `messages`: the chain continued, or a full rendering and the reason why not."""
        why = self._breaks(messages, tools, kwargs)
        if why is None:
            delta = template.delta(messages[len(self.messages) + 1 :], tools, kwargs)
            bridge = delta if self.ended else template.end_of_turn + delta
            return Prompt([*self.ids, *template.encode(bridge)], bridge, None)
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
        """Hold the answered call; the session's next call may continue it."""
        self.ids = array("i", prompt.ids)
        self.ids.extend(sampled)
        self.ended = bool(sampled) and sampled[-1] == end_id
        self.messages, self.answer, self.tools, self.kwargs = messages, answer, tools, kwargs
        if prompt.restart is not None:
            self.started += 1

    def _breaks(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
    ) -> str | None:
        if self.answer is None:
            return FIRST
        if not self.ids:
            return NO_ANSWER
        if tools != self.tools or (kwargs or None) != (self.kwargs or None):
            return SETTINGS
        n = len(self.messages)
        if len(messages) <= n + 1 or messages[:n] != self.messages or not same_turn(messages[n], self.answer):
            return REWRITTEN
        return None


def same_turn(sent: dict[str, Any], answer: dict[str, Any]) -> bool:
    """Whether the harness's assistant message `sent` is the gateway's `answer` as harnesses send it back:
    the same tool calls (name and arguments as JSON values, ids aside) and the same content up to surrounding
    whitespace; reasoning is not compared (harnesses drop or move it)."""
    if sent.get("role") != "assistant":
        return False
    if _text(sent.get("content")).strip() != _text(answer.get("content")).strip():
        return False
    return _calls(sent) == _calls(answer)


def _text(content: Any) -> str:
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
