"""Prompt ids decoded through a session's memo (polar.gateway.backends.prompt_ids) equal a whole decode.

The memo reuses the ids of the text a prompt shares with the session's previous one; these tests hold it to
the plain `orjson.loads` of the same answer for every way a prompt can relate to the previous one (extends
it, repeats it, changes early, shares digits across a number boundary) and for every answer shape it must
leave alone (the key nested, twice, or not an array of int32 integers)."""

from __future__ import annotations

import gc

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.gateway.backends.base import id_sequence
from polar.gateway.backends.prompt_ids import IdsMemo, MemoBudget, decode_answer
from polar.store.codec import TokenIds, ids_to_bytes


def answer(ids: object, **extra: object) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "token_ids": [5, 6]}],
            "usage": {"prompt_tokens": 3},
            "prompt_token_ids": ids,
            **extra,
        }
    )


def check(raw: bytes, memo: IdsMemo | None) -> TokenIds:
    """decode_answer(raw) is orjson.loads(raw) with the ids as TokenIds; returns those."""
    got = decode_answer(raw, memo)
    want = orjson.loads(raw)
    ids = got["prompt_token_ids"]
    assert type(ids) is TokenIds
    assert ids.tolist() == want["prompt_token_ids"]
    assert {**got, "prompt_token_ids": None} == {**want, "prompt_token_ids": None}
    return ids


def test_a_growing_session_decodes_only_the_new_tail_and_matches_a_whole_decode() -> None:
    memo = IdsMemo()
    prompt = list(range(1000, 1500))
    for turn in range(6):
        ids = check(answer(prompt), memo)
        assert memo.ids is ids and memo.text.count(b",") + 1 == len(prompt)
        prompt = [*prompt, 7, 151645, turn, 99999]
    # The memo's int32 bytes are what the store writes: no second packing.
    assert ids_to_bytes(ids) is ids.data


@pytest.mark.parametrize(
    ("prev", "new"),
    [
        ([1, 23], [1, 234, 5]),  # the texts agree on "1,23" but the second number is another one
        ([1, 234, 5], [1, 23]),  # shorter: a compacted history
        ([12, 34, 56], [12, 34, 56]),  # the same prompt again (a retry)
        ([12, 34, 56], [99, 34, 56]),  # changed at the first token
        ([12, 34, 56], [12, 34]),
        ([12, 34, 56], []),
        ([], [1, 2]),
        ([7], [7, 8]),
        ([7, 8], [78]),  # "7,8" vs "78": the comma is where they part
    ],
)
def test_prompts_that_relate_to_the_previous_one_in_any_way_decode_exactly(
    prev: list[int], new: list[int]
) -> None:
    memo = IdsMemo()
    check(answer(prev), memo)
    check(answer(new), memo)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=12),
        min_size=1,
        max_size=5,
    ),
    st.lists(st.integers(min_value=0, max_value=4), min_size=5, max_size=5),
)
def test_any_sequence_of_prompts_decodes_as_a_whole_decode_would(
    pieces: list[list[int]], cuts: list[int]
) -> None:
    """Prompts built as a harness's are (keep some of the previous, add some) and arbitrary ones alike."""
    memo = IdsMemo()
    prompt: list[int] = []
    for piece, cut in zip(pieces, cuts, strict=False):
        prompt = prompt[: len(prompt) * cut // 4] + piece
        check(answer(prompt), memo)


def test_spaced_json_and_key_order_are_read_too() -> None:
    raw = b'{"prompt_token_ids" : [ 1, 2,\n 3 ] , "choices": [{"message": {"content": "x"}}]}'
    memo = IdsMemo()
    assert check(raw, memo) == [1, 2, 3]
    assert check(b'{"prompt_token_ids": [1, 2, 3, 4], "choices": []}', memo) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "raw",
    [
        # SGLang's shape: the ids inside the choice. Left as orjson decodes them.
        b'{"choices": [{"message": {}, "prompt_token_ids": [1, 2]}]}',
        # The key twice (top level and nested): not taken apart.
        b'{"prompt_token_ids": [1], "choices": [{"prompt_token_ids": [2]}]}',
        # Only inside a string (the quotes are escaped there): nothing to find.
        orjson.dumps({"choices": [{"message": {"content": '"prompt_token_ids": [1, 2]'}}]}),
        b'{"prompt_token_ids": null, "choices": []}',
    ],
)
def test_other_shapes_decode_exactly_as_orjson_does(raw: bytes) -> None:
    memo = IdsMemo()
    assert decode_answer(raw, memo) == orjson.loads(raw)
    assert memo.ids is None


@pytest.mark.parametrize(
    "ids",
    [[1, 2.5, 3], [1, "2"], [1, 2**31], [1, -(2**31) - 1], [1, [2], 3], [1, None], [1, {"a": 2}]],
)
def test_arrays_that_are_not_int32_ids_are_left_to_the_ordinary_checks(ids: list[object]) -> None:
    """Decoded whole; `id_sequence` then refuses what is not a list of ints (the record is flagged), and an
    id beyond int32 is refused where it is stored (as before this memo existed)."""
    memo = IdsMemo()
    check(answer([1, 2]), memo)
    got = decode_answer(answer(ids), memo)
    assert got == orjson.loads(answer(ids))
    assert type(got["prompt_token_ids"]) is list
    assert memo.ids == [1, 2]  # the memo keeps the last good prompt


def test_not_json_raises_like_orjson() -> None:
    with pytest.raises(orjson.JSONDecodeError):
        decode_answer(b'{"prompt_token_ids": [1, 2], "choices": ', IdsMemo())
    with pytest.raises(orjson.JSONDecodeError):
        decode_answer(b"<html>bad gateway</html>", None)


def test_token_ids_read_as_a_sequence_of_ints() -> None:
    ids = TokenIds.of([3, -1, 2**31 - 1])
    assert len(ids) == 3 and ids[1] == -1 and ids[-1] == 2**31 - 1 and ids[1:] == [-1, 2**31 - 1]
    assert list(ids) == [3, -1, 2**31 - 1] and ids == (3, -1, 2**31 - 1) and ids != [3]
    assert id_sequence(ids) is ids and TokenIds.of(ids) is ids
    assert "n=3" in repr(ids)
    with pytest.raises(ValueError, match="whole number"):
        TokenIds(b"\x00\x00\x00")


def test_the_memo_budget_empties_the_least_recently_used_memos_and_forgets_dropped_ones() -> None:
    budget = MemoBudget(max_bytes=3000)
    a, b, c = budget.new(), budget.new(), budget.new()
    prompt = list(range(100_000, 100_100))  # 100 ids: 699 bytes of text + 400 of int32
    decode_answer(answer(prompt), a)
    decode_answer(answer(prompt[:90]), b)
    assert budget.nbytes == a.nbytes + b.nbytes and len(budget) == 2
    decode_answer(answer(prompt), c)  # over 3000: a, the least recently used, is emptied
    assert a.ids is None and a.text == b"" and b.ids is not None and c.ids is not None
    assert budget.emptied == 1 and budget.nbytes == b.nbytes + c.nbytes <= 3000
    # An emptied memo still works: its next call decodes whole and it is counted again.
    longer = [*prompt, 1]
    assert check(answer(longer), a) == longer
    assert len(budget) == 2 and budget.nbytes <= 3000 and b.ids is None  # b was the oldest now
    # A memo whose session is gone gives its bytes back.
    held, size = budget.nbytes, c.nbytes
    del c
    gc.collect()
    assert budget.nbytes == held - size == a.nbytes and len(budget) == 1
    assert MemoBudget(0).new().budget is not None
    with pytest.raises(ValueError):
        MemoBudget(-1)


def test_a_gateway_with_no_memo_budget_still_records_exact_ids() -> None:
    """`prompt_memo_bytes: 0`: every memo is emptied at once, and every call decodes its ids whole."""
    budget = MemoBudget(0)
    memo = budget.new()
    for n in (10, 20, 30):
        assert check(answer(list(range(n))), memo) == list(range(n))
        assert memo.ids is None and budget.nbytes == 0
