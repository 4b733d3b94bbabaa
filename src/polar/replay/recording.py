"""A recorded session as the answers to give back: which recorded call an incoming request is, or where it
first differs from the recording.

The gateway records, for every call, the exact body it sent upstream (`upstream_request`) and what came
back (message, token ids, logprobs). A harness run again through a gateway in front of the replay server
sends the same upstream bodies if nothing changed (same CLI, same task, same tool results), so matching is
exact: byte-for-byte equal JSON. Calls may come in another order than recorded (side calls run
concurrently with the main loop), so a request takes the first unused recorded call it equals; a request
that equals none is compared with the next unused one to say where it differs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from polar.jsontypes import JSON
from polar.store.records import CompletionRecord


class RecordingError(ValueError):
    """A store or session that cannot be replayed (missing, or recorded without token data)."""


@dataclass(frozen=True)
class Mismatch:
    """Where a request first differs from the recorded call it was compared with."""

    seq: int  # the recorded call compared with
    where: str  # "messages[3]", "tools", "max_tokens", ...
    expected: Any
    got: Any

    def message(self) -> str:
        """One line: where, and the two texts around their first differing character."""
        old = (
            orjson.dumps(self.expected, option=orjson.OPT_SORT_KEYS).decode()
            if self.expected is not None
            else ""
        )
        new = orjson.dumps(self.got, option=orjson.OPT_SORT_KEYS).decode() if self.got is not None else ""
        at = next(
            (i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new))
        )
        lo = max(0, at - CONTEXT)

        def window(text: str) -> str:
            if not text:
                return "nothing"
            piece = text[lo : at + CONTEXT]
            return ("..." if lo else "") + piece + ("..." if at + CONTEXT < len(text) else "")

        return (
            f"the request differs from the recording (call seq {self.seq}) at {self.where}, character {at}: "
            f"recorded {window(old)} | got {window(new)}"
        )


CONTEXT = 120  # characters shown either side of the first difference


def first_difference(expected: dict[str, Any], got: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first place two upstream bodies differ: a message by index (the usual case: the harness saw
    another tool result, or its prompt changed), else a top-level field; None when they are equal."""
    old, new = expected.get("messages") or [], got.get("messages") or []
    for i in range(max(len(old), len(new))):
        a = old[i] if i < len(old) else None
        b = new[i] if i < len(new) else None
        if a != b:
            return f"messages[{i}]", a, b
    for key in sorted(set(expected) | set(got)):
        if key != "messages" and expected.get(key) != got.get(key):
            return key, expected.get(key), got.get(key)
    return None


class Recording:
    """The calls of one recorded session, each answered at most once."""

    def __init__(self, records: list[CompletionRecord]) -> None:
        if not records:
            raise RecordingError("the session has no recorded calls")
        untrainable = [r.seq for r in records if r.prompt_ids is None or r.response_ids is None]
        if untrainable:
            raise RecordingError(
                f"calls {untrainable} were recorded without token ids (an OpenAI-kind backend?): a replay "
                "must give back the exact tokens, so it cannot serve them"
            )
        self.records = sorted(records, key=lambda r: r.seq)
        self.models = sorted({r.model_served for r in self.records})
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, store: Path, session_id: str) -> Recording:
        from polar.store.sqlite import SQLiteStore

        if not store.is_file():
            raise RecordingError(f"{store}: no such store")
        with SQLiteStore(store) as db:
            records = db.completions(session_id)
            if not records:
                known = [s.session_id for s in db.sessions() if s.completions]
                hint = f" (sessions with calls: {', '.join(known[:5])}{', ...' if len(known) > 5 else ''})"
                raise RecordingError(
                    f"{store}: no calls recorded for session {session_id!r}{hint if known else ''}"
                )
        return cls(records)

    @property
    def remaining(self) -> int:
        return len(self.records) - len(self._used)

    def take(self, body: dict[str, Any]) -> CompletionRecord | Mismatch:
        """The first unused recorded call whose upstream body equals `body` (now used), else where `body`
        differs from the next unused one (or from the last call, when all were used)."""
        with self._lock:
            unused = [r for r in self.records if r.seq not in self._used]
            for record in unused:
                if record.upstream_request == body:
                    self._used.add(record.seq)
                    return record
            for record in self.records:  # equal to a call already answered: asked twice (a retry?)
                if record.upstream_request == body:
                    return Mismatch(record.seq, "the whole request", "one call", "the same call again")
            nearest = unused[0] if unused else self.records[-1]
            diff = first_difference(nearest.upstream_request, body)
            assert diff is not None  # equal bodies were matched above
            return Mismatch(nearest.seq, *diff)

    def prompt_length(self, messages: JSON) -> int | None:
        """Prompt tokens of a recorded call with these messages (`/tokenize` during a replay)."""
        for record in self.records:
            if record.upstream_request.get("messages") == messages and record.prompt_ids is not None:
                return len(record.prompt_ids)
        return None
