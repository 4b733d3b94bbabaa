"""Hypothesis strategies for arbitrary JSON values, shared by the property tests that throw them at parsers
and HTTP surfaces."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_values(
    *,
    int_max: int = 2**63,
    allow_infinity: bool = False,
    text_size: int = 20,
    key_size: int = 12,
    size: int = 4,
    max_leaves: int = 25,
) -> st.SearchStrategy[Any]:
    """Nested lists/objects of null, booleans, integers in [-2**63, `int_max`], floats (never NaN) and
    short strings; `size` bounds each list and object."""
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), int_max),
        st.floats(allow_nan=False, allow_infinity=allow_infinity),
        st.text(max_size=text_size),
    )
    return st.recursive(
        leaf,
        lambda inner: (
            st.lists(inner, max_size=size) | st.dictionaries(st.text(max_size=key_size), inner, max_size=size)
        ),
        max_leaves=max_leaves,
    )


# The HTTP fuzz tests' values: no infinities, integers up to 2**63 (one past int64)
json_value = json_values()
