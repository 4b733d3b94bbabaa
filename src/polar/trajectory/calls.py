"""Records prepared for reconstruction: packed token data, trainability, and the end-of-turn token.

Trainability is decided here, once, and the audit uses the same rule: a sampled token is trainable only
when the server gave its id and logprob (`CompletionRecord.trainable`). `train_without_logprobs` relaxes one
thing for strictly on-policy trainers that recompute logprobs: a call whose only defect is missing logprobs
(the gateway then also sets `not_trainable`, see `polar.gateway.backends.base.token_flags`) is trained with
`response_logprobs=None`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from polar.store.records import FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE, CompletionRecord
from polar.trajectory.errors import BuildError
from polar.trajectory.retries import DEAD_BRANCH, POLICIES, find_dead_branches
from polar.trajectory.tokens import n_tokens, pack

# Flags `train_without_logprobs` may look past: exactly the ones the gateway sets for missing logprobs.
_LOGPROB_ONLY_FLAGS = frozenset({FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE})
_TOKEN_FLAG_PREFIXES = ("missing_", "logprob_", "not_trainable")
# A response that ended because the model stopped (not `length`) ends with the end-of-turn token.
_STOPPED = frozenset({"stop", "tool_calls"})


def eligible(record: CompletionRecord, train_without_logprobs: bool = False) -> bool:
    """Whether `record`'s token data allows loss on its sampled tokens (see module doc); `prepare` also
    requires the ids to be valid token ids."""
    if record.trainable:
        return True
    if not train_without_logprobs or record.response_logprobs is not None:
        return False
    if record.prompt_ids is None or record.response_ids is None:
        return False
    token_flags = {f for f in record.flags if f.startswith(_TOKEN_FLAG_PREFIXES)}
    return token_flags <= _LOGPROB_ONLY_FLAGS


@dataclass(frozen=True, slots=True)
class Call:
    """One record with its prompt and sampled ids packed (see `tokens`)."""

    record: CompletionRecord
    prompt: bytes
    sampled: bytes  # b"" when the server returned no response ids
    trainable: bool

    @property
    def n_prompt(self) -> int:
        return n_tokens(self.prompt)

    @property
    def n_sampled(self) -> int:
        return n_tokens(self.sampled)

    @property
    def response_ids(self) -> list[int]:
        return self.record.response_ids if self.sampled and self.record.response_ids else []

    @property
    def response_logprobs(self) -> list[float] | None:
        """The sampled tokens' logprobs when they carry loss, zeros when masked, None when trained without."""
        if not self.trainable:
            return [0.0] * self.n_sampled
        return self.record.response_logprobs

    @property
    def prompt_messages(self) -> list[dict[str, Any]]:
        msgs = self.record.upstream_request.get("messages")
        return msgs if isinstance(msgs, list) else []


@dataclass(frozen=True, slots=True)
class Prepared:
    calls: list[Call]
    skipped: dict[str, int]  # cause -> calls that cannot be placed in any trace
    sampled_tokens: int  # trainable sampled tokens captured (the coverage denominator)
    untrainable_tokens: int  # sampled tokens captured without the data to train them
    prompt_tokens: int  # prompt tokens captured, over all calls


def prepare(
    records: Sequence[CompletionRecord], train_without_logprobs: bool, dead_branches: str = "train"
) -> Prepared:
    """Pack every record's tokens, in call order. A record without usable prompt ids cannot be placed in a
    token sequence; it is counted under `skipped` (its sampled tokens were never trainable). Retries' dead
    branches are masked or dropped (`skipped["dead_branch"]`) per `dead_branches` (`polar.trajectory.retries`)."""
    if dead_branches not in POLICIES:
        raise BuildError(
            f"dead_branches must be one of {', '.join(POLICIES)}, not {dead_branches!r}",
            param="dead_branches",
        )
    dead = find_dead_branches(records) if dead_branches != "train" else {}
    calls: list[Call] = []
    skipped: Counter[str] = Counter()
    sampled = untrainable = prompt_tokens = 0
    for r in sorted(records, key=lambda r: r.seq):
        n_resp = len(r.response_ids) if r.response_ids is not None else 0
        prompt = pack(r.prompt_ids) if r.prompt_ids is not None else None
        resp = pack(r.response_ids) if r.response_ids is not None else b""
        trainable = prompt is not None and resp is not None and eligible(r, train_without_logprobs)
        if r.completion_id in dead:
            untrainable += n_resp
            if dead_branches == "drop":
                skipped[DEAD_BRANCH] += 1
                continue
            trainable = False
        if trainable:
            sampled += n_resp
        elif r.completion_id not in dead:
            untrainable += n_resp
        if prompt is None:
            skipped["missing_prompt_ids" if r.prompt_ids is None else "invalid_prompt_ids"] += 1
            continue
        prompt_tokens += n_tokens(prompt)
        # Ids no server could have produced: keep the call (its prompt is real), drop its sampled part.
        calls.append(Call(record=r, prompt=prompt, sampled=resp or b"", trainable=trainable))
    return Prepared(calls, dict(skipped), sampled, untrainable, prompt_tokens)


def infer_eot(records: Iterable[CompletionRecord]) -> int | None:
    """The end-of-turn token: the most common last sampled token of calls that stopped on their own.

    Servers return the stop token among the sampled ids (vLLM includes `<|im_end|>` in `token_ids` for a
    Qwen model); `length`-truncated calls are ignored because they end mid-turn."""
    last = Counter(r.response_ids[-1] for r in records if r.finish_reason in _STOPPED and r.response_ids)
    if not last:
        return None
    return last.most_common(1)[0][0]
