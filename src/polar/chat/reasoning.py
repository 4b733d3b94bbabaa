"""`<think>…</think>` reasoning, split from the answer (Qwen3, DeepSeek-R1 and their kin).

Whether the output starts inside a thought depends on the template: Qwen3 lets the model write `<think>`
itself, Qwen3.5 and the 2507 thinking models put `<think>` at the end of the prompt, and
`enable_thinking=False` closes an empty thought in the prompt. vLLM guesses from the output and a request
flag; we know the prompt, so the state is read from it: the output is inside a thought when the prompt's
last `<think>` is not closed, or when the output itself starts with one. A thought that never closes (the
generation hit max_tokens) is all reasoning and no content; output that is not in a thought is all content,
whatever tags it contains (so streamed and whole answers always agree).
"""

from __future__ import annotations

START = "<think>"
END = "</think>"


def prompt_opens_thought(prompt_text: str) -> bool:
    return prompt_text.rfind(START) > prompt_text.rfind(END)


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str | None]:
    """Return (reasoning, content); either is None when empty."""
    stripped = text.lstrip()
    if stripped.startswith(START):
        opened, text = True, stripped[len(START) :]
    if not opened:
        return None, text or None
    if END in text:
        reasoning, _, content = text.partition(END)
        return reasoning, content or None
    return text, None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningStream:
    """Streams reasoning and content deltas, never emitting text a later token could reclassify."""

    def __init__(self, opened: bool) -> None:
        self._opened = opened
        self._buf = ""
        self._r_sent = 0
        self._c_sent = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self._buf += delta
        lead = self._buf.lstrip()
        if not final and not self._opened and len(lead) < len(START) and START.startswith(lead):
            return "", ""  # could still become "<think>"
        reasoning, content = split_reasoning(self._buf, self._opened)
        r = reasoning or ""
        c = content or ""
        if not final and content is None and reasoning is not None:
            r = r[: len(r) - _partial_suffix(r, END)]
        r_out, c_out = r[self._r_sent :], c[self._c_sent :]
        self._r_sent = max(self._r_sent, len(r))
        self._c_sent = max(self._c_sent, len(c))
        return r_out, c_out
