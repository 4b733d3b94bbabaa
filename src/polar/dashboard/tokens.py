"""The token view of a trace: every token the trainer sees, as the audit would read it.

Prompt tokens and masked response tokens (tool results, template glue, untrainable calls) are dimmed;
trainable tokens are coloured by the behaviour policy's logprob (a low-probability token stands out);
each turn's first token is marked, turns whose re-rendering drifted from what was sampled are flagged,
and a trace that does not continue its predecessor says why (`started_by`: a chain break).

Token *text* needs the policy's tokenizer, which polar does not otherwise load on the server: with
`--tokenizer NAME_OR_DIR` (transformers' AutoTokenizer, offline) tokens are shown as text; without, as ids.
`polar run` on its embedded engine passes that engine's tokenizer on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("polar.dashboard")

MAX_TOKENS = 20_000  # per trace on one page; a longer trace is cut, and the page says so

Decode = Callable[[Sequence[int]], list[str]]


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    kind: str  # "prompt", "trainable", "masked"
    logprob: float | None  # trainable tokens only
    turn: int | None  # index of the turn this token starts, else None
    drift: bool  # first token of a turn whose previous turn's re-rendering drifted

    @property
    def band(self) -> str:
        """A colour band for the logprob (CSS class lp0..lp4: likely to unlikely)."""
        if self.logprob is None:
            return ""
        for i, bound in enumerate((-0.05, -0.5, -1.5, -4.0)):
            if self.logprob >= bound:
                return f"lp{i}"
        return "lp4"

    @property
    def title(self) -> str:
        parts = [f"id {self.id}", self.kind]
        if self.logprob is not None:
            parts.append(f"logprob {self.logprob:.3f}")
        if self.turn is not None:
            parts.append(f"turn {self.turn} starts")
        if self.drift:
            parts.append("context drift before this turn")
        return " · ".join(parts)


@dataclass(frozen=True)
class TraceTokens:
    index: int
    tokens: list[Token]
    cut: int  # tokens left out past MAX_TOKENS
    started_by: str | None
    side_call: bool
    reward: float | None
    trainable: int
    has_text: bool


def load_tokenizer(name_or_dir: str) -> Decode:
    """A decoder for token ids, from a local directory or the Hugging Face cache (never the network)."""
    from transformers import AutoTokenizer

    return decoder(AutoTokenizer.from_pretrained(name_or_dir, local_files_only=True))


def decoder(tokenizer: PreTrainedTokenizerBase) -> Decode:
    """Each id as its own text, with a loaded tokenizer (`polar run` passes its embedded engine's).
    Decoding reads the tokenizer only, so sharing it with the engine that encodes with it is safe."""

    def decode(ids: Sequence[int]) -> list[str]:
        return [str(tokenizer.decode([i])) for i in ids]

    return decode


def trace_tokens(index: int, trace: dict[str, Any], decode: Decode | None, side_ids: set[str]) -> TraceTokens:
    """The tokens of one trace (a `Trace` as JSON); `side_ids` are completion ids tagged as side calls."""
    meta = trace.get("metadata") or {}
    prompt = list(trace.get("prompt_ids") or [])
    response = list(trace.get("response_ids") or [])
    mask = list(trace.get("loss_mask") or [0] * len(response))
    logprobs = trace.get("response_logprobs")
    offsets = {off: k for k, off in enumerate(meta.get("turn_offsets") or [])}
    drift = set(meta.get("drift_turns") or [])
    ids = prompt + response
    keep = ids[:MAX_TOKENS]
    texts = decode(keep) if decode is not None else [str(i) for i in keep]
    tokens: list[Token] = []
    for pos, (tid, text) in enumerate(zip(keep, texts, strict=True)):
        if pos < len(prompt):
            tokens.append(Token(tid, text, "prompt", None, None, False))
            continue
        r = pos - len(prompt)
        turn = offsets.get(r)
        trainable = bool(mask[r])
        lp = logprobs[r] if trainable and logprobs is not None else None
        kind = "trainable" if trainable else "masked"
        tokens.append(Token(tid, text, kind, lp, turn, turn is not None and turn in drift))
    completion_ids = set(meta.get("completion_ids") or [])
    return TraceTokens(
        index=index,
        tokens=tokens,
        cut=len(ids) - len(keep),
        started_by=meta.get("started_by"),
        side_call=bool(completion_ids & side_ids),
        reward=trace.get("reward"),
        trainable=sum(mask),
        has_text=decode is not None,
    )


def side_call_ids(records: list[dict[str, Any]]) -> set[str]:
    return {r["completion_id"] for r in records if "side_call" in (r.get("tags") or [])}
