"""The packed-token primitives against naive list implementations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from polar.trajectory.tokens import WINDOW, TipIndex, lcp, pack

# Small alphabets and shared stems make prefixes, equal windows and identical tips common.
tokens = st.lists(st.integers(0, 3), max_size=WINDOW + 6)
stems = st.sampled_from([[], [7] * (WINDOW - 1), [7] * (WINDOW + 3), [1, 2, 3]])


def naive_lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(stems, tokens, tokens)
def test_lcp_matches_naive(stem: list[int], a: list[int], b: list[int]) -> None:
    a, b = stem + a, stem + b
    assert lcp(pack(a) or b"", pack(b) or b"") == naive_lcp(a, b)


def test_pack_rejects_what_is_not_a_token_id() -> None:
    assert pack([1, 2]) is not None
    assert pack([-1]) is None and pack([2**32]) is None and pack(["a"]) is None  # type: ignore[list-item]


ops = st.lists(st.tuples(st.integers(0, 5), stems, tokens, st.booleans()), max_size=25)


@settings(max_examples=300)
@given(ops, stems, tokens)
def test_longest_strict_prefix_matches_naive(
    operations: list, stem: list[int], probe_tail: list[int]
) -> None:
    index: TipIndex[int] = TipIndex()
    tips: dict[int, list[int]] = {}
    for key, s, tail, remove in operations:
        if remove:
            index.remove(key)
            tips.pop(key, None)
        else:
            index.set(key, pack(s + tail) or b"")
            tips[key] = s + tail
            if not tips[key]:
                del tips[key]  # empty tips are never indexed
    probe = stem + probe_tail
    candidates = [(len(t), k) for k, t in tips.items() if len(t) < len(probe) and probe[: len(t)] == t]
    n, keys = index.longest_strict_prefix(pack(probe) or b"")
    if not candidates:
        assert (n, keys) == (0, [])
    else:
        best = max(c[0] for c in candidates)
        assert n == best and sorted(keys) == sorted(k for length, k in candidates if length == best)
    assert len(index) == len(tips)
