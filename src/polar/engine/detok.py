"""Incremental detokenization and stop strings, per sequence.

Decoding the whole output each step is quadratic; decoding only the newest token breaks multi-byte
characters that byte-level BPE splits across tokens. The usual window trick: decode a short window twice
(with and without the new tokens) and emit the difference only once it no longer ends in U+FFFD.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns sampled ids into text deltas; holds back text that might still become a stop string."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._emitted = 0
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def add(self, token_id: int) -> None:
        """Append a token; sets `stop_hit` (and truncates `text`) when a stop string completes."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
            self._append(delta)

    def _append(self, delta: str) -> None:
        old = len(self.text)
        self.text += delta
        if not self._stop or self.stop_hit is not None:
            return
        best: tuple[int, str] | None = None
        for s in self._stop:
            pos = self.text.find(s, max(0, old - len(s) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            pos, s = best
            self.stop_hit = s
            self.text = self.text[: pos + len(s)] if self._include_stop else self.text[:pos]

    def flush(self) -> None:
        """At the end, emit whatever the window still holds (an incomplete character becomes U+FFFD)."""
        if self.stop_hit is None and self._read < len(self._ids):
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix :])
            self._read = len(self._ids)
            if len(after) > len(before):
                self._append(after[len(before) :])

    def take(self, final: bool) -> str:
        """Text not yet handed out; keeps back a possible stop-string prefix unless `final`."""
        end = len(self.text)
        if not final and self.stop_hit is None and self._stop:
            end = max(self._emitted, end - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
