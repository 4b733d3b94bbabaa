"""A server's `prompt_token_ids` decoded without building a Python int per prompt token, per call.

vLLM answers every call with the whole prompt's ids (~6 bytes of JSON a token). Decoded with the rest of
the answer they cost ~3 ms of a 64k-token call (orjson makes 64k ints), checking and packing them to the
store's int32 ~1.5 ms more: the largest part of the gateway's CPU per call, and it grows with the context.
But a session's next prompt starts with its previous one, so the array's text starts with the same bytes.
`IdsMemo` keeps, per session, the previous array's text and its int32 bytes (`TokenIds`): a call compares
texts (a memcmp), reuses the ids of the shared part and decodes only the new tail.

Why equal bytes mean equal ids: JSON numbers in an array end at a comma, so when two texts agree up to and
including a comma, every number before it is the same number. The shared part is measured on every call,
never assumed; a prompt that changed early (compaction, a rewritten history) just decodes more of itself.

Only the top level's `prompt_token_ids` is taken this way (vLLM's and our engine's shape); any other shape,
or text that is not a plain array of integers, is decoded whole by orjson and read as before.

Memory: a memo is ~10 bytes a token (~650 kB at 64k tokens), for as long as its session is in the gateway's
memory. All memos together are bounded by a `MemoBudget`; past it the least recently used are emptied, and
their sessions' next calls decode their ids whole, once.
"""

from __future__ import annotations

import re
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial

import orjson

from polar.jsontypes import JSON
from polar.store.codec import TokenIds, common_prefix, ids_to_bytes

_KEY = b'"prompt_token_ids"'
_OPEN = re.compile(rb"\s*:\s*\[")

DEFAULT_MEMO_BYTES = 128 << 20  # ~200 live sessions of 64k tokens, ~1,600 of 8k


@dataclass(slots=True, weakref_slot=True)
class IdsMemo:
    """One session's previous prompt ids: the array's text between its brackets, and the ids."""

    budget: MemoBudget | None = None
    text: bytes = b""
    ids: TokenIds | None = None

    @property
    def nbytes(self) -> int:
        return len(self.text) + (len(self.ids.data) if self.ids is not None else 0)

    def remember(self, text: bytes, ids: TokenIds) -> None:
        self.text, self.ids = text, ids
        if self.budget is not None:
            self.budget.charge(self)

    def clear(self) -> None:
        self.text, self.ids = b"", None


class MemoBudget:
    """The memos of every session together, at most `max_bytes`: the least recently updated are emptied
    first. Memos are held weakly: a session the registry forgot takes its memo with it."""

    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be zero or more")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.emptied = 0  # memos emptied to stay within the budget
        self._memos: OrderedDict[int, tuple[weakref.ref[IdsMemo], int]] = OrderedDict()

    def new(self) -> IdsMemo:
        return IdsMemo(self)

    def __len__(self) -> int:
        return len(self._memos)

    def charge(self, memo: IdsMemo) -> None:
        """`memo` was just updated: count its new size, then empty the oldest memos while over budget."""
        key = id(memo)
        old = self._memos.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        size = memo.nbytes
        self._memos[key] = (weakref.ref(memo, partial(self._gone, key)), size)
        self.nbytes += size
        while self.nbytes > self.max_bytes and self._memos:
            _, (ref, n) = self._memos.popitem(last=False)
            self.nbytes -= n
            stale = ref()
            if stale is not None:
                stale.clear()
                self.emptied += 1

    def _gone(self, key: int, ref: weakref.ref[IdsMemo]) -> None:
        entry = self._memos.get(key)
        if entry is not None and entry[0] is ref:
            del self._memos[key]
            self.nbytes -= entry[1]


def decode_answer(raw: bytes, memo: IdsMemo | None) -> JSON:
    """`raw` decoded as orjson would, except that a top-level `prompt_token_ids` array of integers comes
    back as `TokenIds`, decoded through `memo` (which is updated). Raises `orjson.JSONDecodeError` like
    `orjson.loads` on a body that is not JSON."""
    found = _find_array(raw)
    if found is None:
        return orjson.loads(raw)
    start, end = found
    try:
        rest = orjson.loads(b"".join((raw[: start - 1], b"[]", raw[end + 1 :])))
    except orjson.JSONDecodeError:
        return orjson.loads(raw)
    if type(rest) is not dict or rest.get("prompt_token_ids") != []:
        return orjson.loads(raw)  # the key was not at the top level after all
    text = raw[start:end]
    ids = _decode_ids(text, memo)
    if ids is None:
        return orjson.loads(raw)  # not an array of int32 integers: read (and flagged) the usual way
    rest["prompt_token_ids"] = ids
    if memo is not None:
        memo.remember(text, ids)
    return rest


def _find_array(raw: bytes) -> tuple[int, int] | None:
    """(start, end) of the text between the brackets of the only `"prompt_token_ids": [...]`, else None.

    The pattern cannot occur inside a JSON string (its quotes would be escaped there); a second occurrence
    (a nested object with the same key) sends the body down the ordinary path."""
    at = raw.find(_KEY)
    if at < 0 or raw.find(_KEY, at + len(_KEY)) >= 0:
        return None
    m = _OPEN.match(raw, at + len(_KEY))
    if m is None:
        return None
    end = raw.find(b"]", m.end())
    return None if end < 0 else (m.end(), end)


def _decode_ids(text: bytes, memo: IdsMemo | None) -> TokenIds | None:
    """The ids of an array's inner text, reusing `memo`'s for a shared prefix; None if not all int32."""
    shared, tail_at = 0, 0
    if memo is not None and memo.ids is not None and memo.text:
        shared, tail_at = _shared(memo.text, len(memo.ids), text)
    try:
        tail = orjson.loads(b"[" + text[tail_at:] + b"]") if tail_at < len(text) else []
        # `sum` checks every entry is an int in C (see base.int_list); packing, that it fits int32.
        if type(sum(tail)) is not int:
            return None
        packed = ids_to_bytes(tail)
    except (orjson.JSONDecodeError, TypeError, OverflowError):
        return None
    if shared:
        assert memo is not None and memo.ids is not None
        packed = memo.ids.data[: shared * 4] + packed
    return TokenIds(packed)


def _shared(prev: bytes, count: int, text: bytes) -> tuple[int, int]:
    """(ids of `prev`, which holds `count`, that `text` repeats; where `text`'s remaining ids start)."""
    n = len(prev)
    if text.startswith(prev):
        if len(text) == n:
            return count, n
        if text[n] == 0x2C:  # ","
            return count, n + 1  # the common case: the whole previous prompt, then more
    common = common_prefix(prev, text)
    comma = text.rfind(b",", 0, common)
    if comma < 0:
        return 0, 0
    # Every number before this comma is complete and equal in both texts.
    return prev.count(b",", 0, comma) + 1, comma + 1
