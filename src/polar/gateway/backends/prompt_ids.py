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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from polar.store.codec import TokenIds, ids_to_bytes

_KEY = b'"prompt_token_ids"'
_OPEN = re.compile(rb"\s*:\s*\[")


@dataclass(slots=True)
class IdsMemo:
    """One session's previous prompt ids: the array's text between its brackets, and the ids.

    Memory is the text (~6 bytes a token) plus the int32 bytes (4), which are the same object the record
    and the store's session cache hold; it lives as long as the session stays in the gateway's memory."""

    text: bytes = b""
    ids: TokenIds | None = None

    @property
    def nbytes(self) -> int:
        return len(self.text) + (len(self.ids.data) if self.ids is not None else 0)


def decode_answer(raw: bytes, memo: IdsMemo | None) -> Any:
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
        memo.text, memo.ids = text, ids
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
    common = _common_prefix(prev, text)
    comma = text.rfind(b",", 0, common)
    if comma < 0:
        return 0, 0
    # Every number before this comma is complete and equal in both texts.
    return prev.count(b",", 0, comma) + 1, comma + 1


def _common_prefix(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix of two byte strings (a binary search of memcmps, no copies)."""
    view = memoryview(a)
    lo, hi = 0, min(len(a), len(b)) + 1  # invariant: first lo bytes equal, first hi bytes differ
    if b.startswith(view[: hi - 1]):
        return hi - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if b.startswith(view[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo
