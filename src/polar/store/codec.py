"""Compact encodings that make storage grow with what is new, not with context length.

Agent prompts repeat everything before them: call k+1 of a session re-sends call k's messages, tools and
system prompt, and its prompt token ids extend call k's. Two encodings exploit that:

- token ids are little-endian int32 arrays, and a prompt is stored as "the first `shared` tokens of an
  earlier prompt of the session" plus its new tail (`prefix_len` finds the shared length with memcmp-speed
  slice comparisons);
- JSON bodies are split into a small skeleton and content-addressed blobs (each element of a large
  top-level list, or a large top-level value), so a message or tool list seen before costs a 16-byte hash.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import orjson

if TYPE_CHECKING:
    from _hashlib import HASH  # what hashlib's constructors return

_INT32 = "i"
assert array(_INT32).itemsize == 4

# Values whose JSON is shorter than this stay inline in the skeleton: a blob reference costs ~40 bytes.
INLINE_LIMIT = 256
_RAW, _ZLIB = b"r", b"z"


class TokenIds(Sequence[int]):
    """Token ids held as native int32 bytes (the store's format), read as a sequence of ints.

    A 64k-token prompt as a Python list is 64k int objects (~2.3 MB, ~3 ms to decode from JSON and ~1 ms to
    pack); as bytes it is 256 kB and reaches the store without conversion. The gateway builds prompts this
    way (`polar.gateway.backends.prompt_ids`); everything that reads ids takes any `Sequence[int]`."""

    __slots__ = ("_view", "data")

    def __init__(self, data: bytes) -> None:
        if len(data) % 4:
            raise ValueError(f"int32 token data of {len(data)} bytes is not a whole number of ids")
        self.data = data
        self._view = memoryview(data).cast("i")  # _INT32

    @classmethod
    def of(cls, ids: Sequence[int]) -> TokenIds:
        return ids if isinstance(ids, TokenIds) else cls(ids_to_bytes(ids))

    def __len__(self) -> int:
        return len(self._view)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self._view[i].tolist()
        return int(self._view[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self._view.tolist())

    def tolist(self) -> list[int]:
        return self._view.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self.data == other.data
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.data)

    def __repr__(self) -> str:
        head = ", ".join(str(i) for i in self._view[:8].tolist())
        return f"TokenIds([{head}{', ...' if len(self) > 8 else ''}], n={len(self)})"

    def __reduce__(self) -> tuple[type[TokenIds], tuple[bytes]]:
        return TokenIds, (self.data,)


def ids_to_bytes(ids: Sequence[int]) -> bytes:
    """Native int32 bytes, as `array("i", ids).tobytes()` but in one C pass straight into the bytes object
    (the array's copy out cost as much again: ~1.5 ms a 64k-token prompt here). Out of range: OverflowError.
    `TokenIds` already are those bytes."""
    if isinstance(ids, TokenIds):
        return ids.data
    try:
        return struct.pack(f"={len(ids)}i", *ids)
    except struct.error as exc:
        raise OverflowError(f"token id out of int32 range or not an integer: {exc}") from None


def bytes_to_ids(data: bytes) -> list[int]:
    arr = array(_INT32)
    arr.frombytes(data)
    return arr.tolist()


def floats_to_bytes(values: list[float]) -> bytes:
    # float64: a logprob must read back bit-identical to what the server returned.
    return array("d", values).tobytes()


def bytes_to_floats(data: bytes) -> list[float]:
    arr = array("d")
    arr.frombytes(data)
    return arr.tolist()


def prefix_len(a: bytes, b: bytes) -> int:
    """Number of leading int32 tokens two id arrays share."""
    return common_prefix(a, b, 4)


def common_prefix(a: bytes, b: bytes, unit: int = 1) -> int:
    """Number of leading `unit`-byte items two byte strings share.

    `startswith` on memoryview slices is a memcmp without copies: the common case (an earlier prompt that
    `b` extends) is one comparison, and a mismatch is a binary search of memcmps, never a slice copy (a
    64k-token prompt is 256 kB; copying it at every step cost ~1 ms a call)."""
    n = min(len(a), len(b)) // unit
    view = memoryview(a)
    if b.startswith(view[: n * unit]):
        return n
    lo, hi = 0, n  # invariant: first lo items equal, first hi items differ
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if b.startswith(view[lo * unit : mid * unit], lo * unit):
            lo = mid
        else:
            hi = mid
    return lo


def pack_blob(data: bytes) -> bytes:
    if len(data) >= INLINE_LIMIT:
        packed = zlib.compress(data, 1)
        if len(packed) < len(data):
            return _ZLIB + packed
    return _RAW + data


def unpack_blob(data: bytes) -> bytes:
    if data[:1] == _ZLIB:
        return zlib.decompress(data[1:])
    return data[1:]


def blob_hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


Refs = dict[str, list[str]]  # top-level list key -> hex hashes of its elements, in order


@dataclass(frozen=True, slots=True)
class ListState:
    """What the next body of a chain needs to know about one of this body's stored lists.

    `hashes` are the elements' blob hashes (16 bytes each, packed: a list of hex strings cost ~90 bytes per
    message and was kept for every live session). `json_len` and `json_digest` cover the list's JSON up to
    its closing bracket, so the next body can prove its list starts with the same elements by hashing one
    contiguous byte range, instead of encoding and hashing every element again (the per-call cost that grew
    with context)."""

    hashes: bytes
    json_len: int
    json_digest: bytes

    def refs(self) -> list[str]:
        h = self.hashes
        return [h[i : i + 16].hex() for i in range(0, len(h), 16)]

    @property
    def nbytes(self) -> int:
        """Memory held, roughly: the packed hashes, the digest and the objects' overhead."""
        return len(self.hashes) + 200


Chain = dict[str, ListState]  # top-level list key -> its state, for the next body of the same chain


def _shared_prefix(full: bytes, prev: ListState | None, digest: HASH) -> bool:
    """Whether `full` (a list's JSON) starts with exactly the elements `prev` described. Feeds `digest`
    (a sha256 over `full`'s bytes before the bracket) up to that point either way."""
    if prev is None or prev.json_len >= len(full) or full[prev.json_len] not in _ELEMENT_END:
        return False
    digest.update(memoryview(full)[: prev.json_len])
    # orjson writes a list as `[` + elements joined by `,` + `]`, and a JSON value ends where a parser says
    # it does: equal bytes up to `,` or `]` mean the same first elements.
    return bool(digest.copy().digest() == prev.json_digest)


_ELEMENT_END = (ord(","), ord("]"))


@dataclass(frozen=True, slots=True)
class ListSplit:
    """How one list was split, for another body of the same record that sends the same list (`split_json`'s
    `splits`): its JSON, the chain state it extended and from which record, and what that gave."""

    full: bytes
    prev: ListState | None
    base: int | None
    entry: Any  # the skeleton's `lists` entry
    state: ListState
    blobs: dict[bytes, bytes]


def split_json(
    obj: dict[str, Any],
    previous: Chain | None = None,
    base: int | None = None,
    splits: dict[str, ListSplit] | None = None,
) -> tuple[bytes, dict[bytes, bytes], Chain]:
    """Encode a JSON object as (skeleton bytes, {hash: element JSON}, the lists' state for the next body).

    The skeleton is `{"order": [keys], "inline": {...}, "lists": {key: [hex, ...]}, "values": {key: hex}}`;
    keeping refs out of the user's own keys means no content can be mistaken for a reference, and `order`
    restores the body's key order. When `previous` (the lists of the record `base`) holds a prefix of a list,
    that list is stored as `{"b": base, "n": shared, "t": [new hex, ...]}`: a harness resends its whole
    history every call, so each call then stores only the messages that are new, and encodes and hashes only
    those (the shared prefix is checked with one digest over its bytes).

    `splits` holds the lists split earlier for the same record, by key, and gets this body's: a list whose
    JSON, previous state and base equal one there is that split again. The gateway's upstream body mostly
    sends the harness's messages and tools as they came, and proving their prefix again was a second digest
    over the whole history a call.
    """
    inline: dict[str, Any] = {}
    lists: dict[str, Any] = {}
    state: Chain = {}
    values: dict[str, str] = {}
    blobs: dict[bytes, bytes] = {}
    for key, value in obj.items():
        if isinstance(value, list) and value:
            full = orjson.dumps(value)
            if len(full) - len(value) - 1 < INLINE_LIMIT:  # the elements' bytes, without brackets and commas
                inline[key] = value
                continue
            prev = None if previous is None or base is None else previous.get(key)
            done = None if splits is None else splits.get(key)
            if done is not None and done.full == full and done.prev == prev and done.base == base:
                lists[key], state[key] = done.entry, done.state
                blobs.update(done.blobs)
                continue
            digest = hashlib.sha256()
            shared = prev is not None and _shared_prefix(full, prev, digest)
            if shared:
                assert prev is not None
                n = len(prev.hashes) // 16
                digest.update(memoryview(full)[prev.json_len : len(full) - 1])
                known = [prev.hashes]
            else:
                n = 0
                digest = hashlib.sha256(memoryview(full)[: len(full) - 1])
                known = []
            new, mine = [], {}
            for v in value[n:]:
                e = orjson.dumps(v)
                h = blob_hash(e)
                mine[h] = e
                new.append(h)
            blobs.update(mine)
            state[key] = ListState(b"".join(known + new), len(full) - 1, digest.digest())
            tail = [h.hex() for h in new]
            lists[key] = {"b": base, "n": n, "t": tail} if shared else tail
            if splits is not None:
                splits[key] = ListSplit(full, prev, base, lists[key], state[key], mine)
        elif isinstance(value, (dict, str)):
            e = orjson.dumps(value)
            if len(e) < INLINE_LIMIT:
                inline[key] = value
                continue
            h = blob_hash(e)
            blobs[h] = e
            values[key] = h.hex()
        else:
            inline[key] = value
    skeleton = orjson.dumps({"order": list(obj), "inline": inline, "lists": lists, "values": values})
    return skeleton, blobs, state


def join_json(
    skeleton: bytes, blob: dict[bytes, bytes] | Any, resolved: dict[int, Refs] | None = None
) -> tuple[dict[str, Any], Refs]:
    """Inverse of `split_json`: the object and its lists' full refs. `blob` maps a 16-byte hash to the
    element's JSON bytes; `resolved` holds the full refs of earlier records that chained lists point at."""
    sk = orjson.loads(skeleton)
    parts: dict[str, Any] = dict(sk["inline"])
    full: Refs = {}
    for key, entry in sk["lists"].items():
        if isinstance(entry, dict):
            if resolved is None or entry["b"] not in resolved:
                raise ValueError(f"list {key!r} extends record {entry['b']}, which was not read before it")
            refs = resolved[entry["b"]][key][: entry["n"]] + entry["t"]
        else:
            refs = entry
        full[key] = refs
        parts[key] = [orjson.loads(blob[bytes.fromhex(h)]) for h in refs]
    for key, h in sk["values"].items():
        parts[key] = orjson.loads(blob[bytes.fromhex(h)])
    return {key: parts[key] for key in sk["order"]}, full


def chain_bases(skeleton: bytes) -> set[int]:
    """The records a skeleton's chained lists extend (they must be joined before it)."""
    return {entry["b"] for entry in orjson.loads(skeleton)["lists"].values() if isinstance(entry, dict)}


def skeleton_refs(skeleton: bytes) -> list[bytes]:
    """The blob hashes a skeleton adds itself (a chained list's shared part is its base's)."""
    sk = orjson.loads(skeleton)
    refs: list[bytes] = []
    for entry in sk["lists"].values():
        refs.extend(bytes.fromhex(h) for h in (entry["t"] if isinstance(entry, dict) else entry))
    refs.extend(bytes.fromhex(h) for h in sk["values"].values())
    return refs
