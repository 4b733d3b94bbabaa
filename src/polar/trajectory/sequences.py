"""A chain of turns as one `Trace`: prompt p1; response a1 ‖ u1 ‖ a2 ‖ … ‖ ak.

a_i are the sampled ids (mask 1 and the server's logprobs when the call is trainable, else mask 0 and
0.0); u_i is the interstitial, the tail of p_{i+1} from the turn's `cut` (mask 0, logprob 0.0). Every token
is copied from a record, never recomputed. `turn_offsets` in the metadata say where each a_i starts in
`response_ids`; the audit checks traces against records through them (a custom builder that wants its
traces audited writes the same keys).
"""

from __future__ import annotations

from typing import Any

from polar.trajectory.chains import Chain
from polar.trajectory.models import Trace


def chain_trace(chain: Chain) -> Trace:
    turns = chain.turns
    first = turns[0].call
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    logprobs_missing = False
    offsets: list[int] = []
    messages: list[dict[str, Any]] = []
    history = first.prompt_messages
    flags: dict[str, list[str]] = {}
    for k, turn in enumerate(turns):
        call = turn.call
        if k:
            interstitial = (call.record.prompt_ids or [])[turn.cut :]
            response += interstitial
            mask += [0] * len(interstitial)
            logprobs += [0.0] * len(interstitial)
            # Messages the harness added after the previous assistant turn (tool results, user turns).
            msgs = call.prompt_messages
            messages += msgs[len(history) + 1 :]
            history = msgs
        offsets.append(len(response))
        sampled = call.response_ids
        response += sampled
        mask += [1 if call.trainable else 0] * len(sampled)
        lp = call.response_logprobs
        if lp is None:
            logprobs_missing = True
            logprobs += [0.0] * len(sampled)
        else:
            logprobs += lp
        messages.append(call.record.response_message)
        if call.record.flags:
            flags[call.record.completion_id] = list(call.record.flags)
    versions = [t.call.record.policy_version for t in turns]
    known = [v for v in versions if v is not None]
    metadata: dict[str, Any] = {
        "session_id": first.record.session_id,
        "chain_index": chain.index,
        "completion_ids": [t.call.record.completion_id for t in turns],
        "seqs": [t.call.record.seq for t in turns],
        "turn_offsets": offsets,
        # The oldest policy that produced tokens here: what a staleness filter must compare against.
        "policy_version": min(known) if known else None,
        "policy_versions": versions,
        "started_by": chain.started_by,
        "drift_turns": [k for k, t in enumerate(turns) if t.drift],
        "trainable_tokens": sum(mask),
    }
    for name in ("sibling_of", "retry_of", "split_from", "diverged_from"):
        value = getattr(chain, name)
        if value is not None:
            metadata[name] = value
    if flags:
        metadata["flags"] = flags
    return Trace.trusted(
        prompt_ids=list(first.record.prompt_ids or []),
        response_ids=response,
        loss_mask=mask,
        response_logprobs=None if logprobs_missing else logprobs,
        prompt_messages=first.prompt_messages,
        response_messages=messages,
        tools=first.record.tools,
        finish_reason=turns[-1].call.record.finish_reason,
        reward=None,
        metadata=metadata,
    )
