"""Give the policy back the tool-call arguments it actually wrote.

Harnesses keep a parsed copy of each tool call and serialize it again when they send the history back:
Qwen Code, OpenCode and Pi write compact JSON (`{"command":"ls"}` where the model wrote
`{"command": "ls"}`), and the Anthropic and Gemini dialects carry arguments as objects, which the gateway
must serialize itself. The next prompt then holds tokens the policy never produced, the chain breaks there
(context drift) and training sees a context the model did not. The gateway remembers, per session, the
arguments text of every call it returned, and when a call comes back under the same id with arguments that
are the *same JSON value*, it puts the original text back. Anything the harness really changed is left as
sent.

A call that comes back without any id (Pi's Gemini dialect drops `functionCall.id`; the gateway then
names it `unnamed_call_<i>_<j>`) is matched by tool name and JSON value instead, when the session's policy
wrote exactly one text for that value (two different texts of one value: which one is unknowable, so it
is left as sent). A call under an id the harness chose itself is never matched by value: it may be
another call.

The text before a turn's tool calls has the same problem at its end. vLLM's hermes parser (0.32) returns as
content everything before `<tool_call>`, the newline the model wrote before it included ("Step 0.\n"), and
Qwen's chat templates (Qwen2.5, Qwen3, Hermes-2-Pro) write a newline of their own between content and the
first call: the next prompt reads "Step 0.\n\n<tool_call>" where the policy sampled one newline, and every
turn of a session drifts (measured with the real vLLM: bench/harnesses.py --vllm). So the gateway also
remembers the content each tool-calling turn came with; when it comes back unchanged with that turn's first
call, one trailing newline (`SEPARATOR`, what those templates add back) is taken off upstream. Content the
harness changed, or that does not end in a newline (a parser that strips it, the fake), is left as sent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import orjson

from polar.gateway.canonical import UNNAMED_CALL_PREFIX, CanonicalRequest, ToolCall
from polar.jsontypes import JSON

SEPARATOR = "\n"  # what a Qwen-style template writes between an assistant turn's content and its first call


class ToolArguments:
    """The arguments text of the calls a session's policy made, by call id, and the content of the turns
    that made them, by their first call's id (bounded, oldest dropped)."""

    def __init__(self, limit: int = 4096) -> None:
        self._by_id: OrderedDict[str, str] = OrderedDict()
        self._content: OrderedDict[str, str] = OrderedDict()  # first call id -> content ending in SEPARATOR
        # (tool name, the value as canonical JSON) -> the texts the policy wrote for it (for lost ids)
        self._by_value: OrderedDict[tuple[str, bytes], set[str]] = OrderedDict()
        self._limit = limit

    def remember(self, calls: tuple[ToolCall, ...], content: str | None = None) -> None:
        self.remember_text((call.id, call.arguments) for call in calls)
        if calls and content is not None:
            self.remember_content(calls[0].id, content)
        for call in calls:
            key = _value_key(call.name, call.arguments)
            if key is not None:
                self._by_value.setdefault(key, set()).add(call.arguments)
                self._by_value.move_to_end(key)
        while len(self._by_value) > self._limit:
            self._by_value.popitem(last=False)

    def remember_text(self, calls: Iterable[tuple[str, str]]) -> None:
        """Remember (call id, arguments text) pairs, oldest first (also: a session loaded from the store)."""
        for call_id, arguments in calls:
            self._by_id[call_id] = arguments
            self._by_id.move_to_end(call_id)
        while len(self._by_id) > self._limit:
            self._by_id.popitem(last=False)

    def remember_content(self, first_call_id: str, content: str) -> None:
        """The content a tool-calling turn came with, when a template would add its separator to it: not
        when it is the separator alone (taken off, the content is empty, and templates add nothing then)."""
        if content.endswith(SEPARATOR) and content != SEPARATOR:
            self._content[first_call_id] = content
            self._content.move_to_end(first_call_id)
            while len(self._content) > self._limit:
                self._content.popitem(last=False)

    def restore_separators(self, req: CanonicalRequest) -> tuple[CanonicalRequest, int]:
        """`req` with the separator taken off the content its tool-calling turns came with, and how many."""
        if not self._content:
            return req, 0
        messages: list[dict[str, Any]] | None = None
        restored = 0
        for i, msg in enumerate(req.messages):
            calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
            if not calls or not isinstance(calls[0], dict):
                continue
            original = self._content.get(str(calls[0].get("id")))
            content = msg.get("content")
            if original is None:
                continue
            if content == original:
                new_content: JSON = original[: -len(SEPARATOR)]
            elif isinstance(content, list) and _texts(content) == original:
                last = content[-1]
                new_content = [*content[:-1], {**last, "text": last["text"][: -len(SEPARATOR)]}]
            else:
                continue  # the harness changed it: as sent
            if messages is None:
                messages = list(req.messages)
            messages[i] = {**msg, "content": new_content}
            restored += 1
        if messages is None:
            return req, 0
        return replace(req, messages=messages), restored

    def restore(self, req: CanonicalRequest) -> tuple[CanonicalRequest, int]:
        """`req` with re-serialized arguments replaced by the sampled text, and how many were."""
        if not self._by_id:
            return req, 0
        restored = 0
        messages: list[dict[str, Any]] | None = None
        for i, msg in enumerate(req.messages):
            calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
            if not calls:
                continue
            new_calls = None
            for j, call in enumerate(calls):
                original = self._original(call)
                if original is None:
                    continue
                if new_calls is None:
                    new_calls = list(calls)
                new_calls[j] = {**call, "function": {**call["function"], "arguments": original}}
                restored += 1
            if new_calls is not None:
                if messages is None:
                    messages = list(req.messages)
                messages[i] = {**msg, "tool_calls": new_calls}
        if messages is None:
            return req, 0
        return replace(req, messages=messages), restored

    def _original(self, call: JSON) -> str | None:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            return None
        sent = call["function"].get("arguments")
        original = self._by_id.get(str(call.get("id")))
        unnamed = str(call.get("id")).startswith(UNNAMED_CALL_PREFIX)
        if original is None and unnamed and isinstance(sent, str):  # no id came back: by name and value
            key = _value_key(call["function"].get("name"), sent)
            texts = self._by_value.get(key) if key is not None else None
            original = next(iter(texts)) if texts is not None and len(texts) == 1 else None
        if original is None or not isinstance(sent, str) or sent == original:
            return None
        try:
            same = orjson.loads(sent) == orjson.loads(original)
        except orjson.JSONDecodeError:
            return None
        return original if same else None


def _value_key(name: JSON, arguments: str) -> tuple[str, bytes] | None:
    """(name, canonical JSON of the arguments' value), or None when they are not JSON."""
    if not isinstance(name, str):
        return None
    try:
        return name, orjson.dumps(orjson.loads(arguments), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONDecodeError:
        return None


def _texts(parts: list[Any]) -> str | None:
    """The text of content parts that are all text (the last one holding the end), else None."""
    if not parts or not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        return None
    if not isinstance(parts[-1].get("text"), str) or not parts[-1]["text"].endswith(SEPARATOR):
        return None
    return "".join(str(p.get("text", "")) for p in parts)
