"""A session's previous messages, as sent and as parsed, so that its next call parses only what it adds.

A harness resends its whole history with every call. Validating it (pydantic) and translating each message
into the canonical shape cost ~0.4 ms a call at 64k tokens of history here, every call, for messages the
session's previous call already sent. `KnownMessages` keeps the previous call's messages as they came (the
decoded JSON) and as the dialect made them; the next call compares its messages with them (`==`, in C) and
validates and translates only those after the shared part, taking the parsed ones for the rest.

Why equal means the same result: validation of a message depends on that message alone, its output has the
schema's keys in the schema's order (not the sender's), and a value that validated as a string, list or
object equals another only if it is the same JSON. A call whose new messages fail is validated whole
again, so that its error names the field where the caller put it (`messages[41].content`).

The parsed messages are shared by the calls that reuse them: nothing after parsing changes a message in
place (quirks, restored tool arguments and separators copy what they change).

Memory: ~3x the messages' JSON (the decoded objects and the parsed ones; measured with tracemalloc, 0.7 MB
for 64k tokens), for as long as the session is in the gateway's memory; all of them together stay within a
`MemoBudget` (past it the least recently updated are emptied, and their sessions' next calls parse whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from polar.gateway.backends.prompt_ids import MemoBudget

DEFAULT_MESSAGE_MEMO_BYTES = 64 << 20  # ~90 live sessions of 64k tokens, ~700 of 8k
# Bytes held per byte of the messages' JSON (decoded objects ~1.9x, parsed dicts ~0.8x; tracemalloc).
OBJECT_BYTES_PER_JSON_BYTE = 3


@dataclass(slots=True, weakref_slot=True)
class KnownMessages:
    """One session's previous messages: `raw` as decoded, `parsed` as the dialect made them."""

    budget: MemoBudget | None = None
    raw: list[Any] = field(default_factory=list)
    parsed: list[dict[str, Any]] = field(default_factory=list)
    size: int = 0  # estimated bytes held
    reused: int = 0  # messages the last call took from here (for tests and curiosity)

    @property
    def nbytes(self) -> int:
        return self.size

    def shared(self, raw: list[Any]) -> int:
        """How many leading messages of `raw` are the previous call's."""
        prev = self.raw
        n = len(prev)
        if n and len(raw) >= n and raw[:n] == prev:  # the common case: the history grew
            return n
        k = 0
        for new, old in zip(raw, prev, strict=False):  # they may differ in length
            if new != old:
                break
            k += 1
        return k

    def remember(self, raw: list[Any], parsed: list[dict[str, Any]], same: int, reused: int) -> None:
        """Keep a call's messages: `raw` as sent, of which `same` were the previous call's, and `parsed`,
        of which `reused` came from here. The size is counted from the JSON of the new messages only when
        `raw` extends what was kept."""
        grew = bool(same) and same == len(self.raw)
        added = raw[same:] if grew else raw
        self.size = (self.size if grew else 0) + (
            OBJECT_BYTES_PER_JSON_BYTE * len(orjson.dumps(added)) if added else 0
        )
        self.raw, self.parsed, self.reused = raw, parsed, reused
        if self.budget is not None:
            self.budget.charge(self)

    def clear(self) -> None:
        self.raw, self.parsed, self.size = [], [], 0
