"""`<think>` splitting, whole and streamed."""

from __future__ import annotations

import random

import pytest

from polar.chat.reasoning import ReasoningStream, prompt_opens_thought, split_reasoning


@pytest.mark.parametrize(
    ("text", "opened", "want"),
    [
        ("<think>\nplan\n</think>\n\nanswer", False, ("\nplan\n", "\n\nanswer")),
        ("plan</think>answer", True, ("plan", "answer")),
        ("<think>still thinking", False, ("still thinking", None)),  # cut by max_tokens
        ("still thinking", True, ("still thinking", None)),
        ("plain answer", False, (None, "plain answer")),
        ("talks about </think> tags", False, (None, "talks about </think> tags")),
        ("<think>\n\n</think>\n\n", False, ("\n\n", "\n\n")),
        ("", True, ("", None)),
    ],
)
def test_split(text: str, opened: bool, want: tuple[str | None, str | None]) -> None:
    assert split_reasoning(text, opened) == want


def test_prompt_state() -> None:
    assert prompt_opens_thought("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thought("<|im_start|>assistant\n")
    assert not prompt_opens_thought("<think>a</think> old turn <|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("text", "opened"),
    [
        ("<think>\nI should list files.\n</think>\n\nHere they are.", False),
        ("reasoning only, then </think>answer", True),
        ("<think>never closes <th", False),
        ("no thought at all <think> here", False),
        ("  <thi", False),
    ],
)
def test_stream_matches_whole(text: str, opened: bool) -> None:
    want_r, want_c = split_reasoning(text, opened)
    rng = random.Random(1)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        st = ReasoningStream(opened)
        r = c = ""
        for i, piece in enumerate(pieces):
            dr, dc = st.feed(piece, final=i == len(pieces) - 1)
            r, c = r + dr, c + dc
        assert r == (want_r or "")
        assert c == (want_c or "")
