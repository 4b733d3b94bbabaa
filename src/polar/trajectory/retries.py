"""Retries and the dead branches they leave: a harness sends the same prompt again and drops the answer.

Qwen Code resends a prompt cut by `finish_reason=length` with a larger `max_tokens`; Gemini CLI and
Qwen Code resend a call whose stream they judged invalid. Each time the first answer was recorded (the
gateway committed it before the harness judged it) but never became part of the conversation: a dead
branch. Left alone it is a trace of its own, trained as if the policy had acted on it, and its retry starts
another trace (`chains.RETRY`) instead of continuing the conversation.

Found on tokens, once the session is over, when it is known what was used: among calls with exactly the
same server prompt, one whose sampled tokens no later call's prompt continues (prompt ‖ sampled) is a dead
branch (`find_dead_branches` says which survives when none is continued). Only exact prompt equality counts: a harness that re-serializes history (Qwen,
OpenCode, Pi) makes every continuation differ from the sampled tokens, so a looser test would call used
answers dead. A failed call (no completion, only a failure record) leaves no tokens and is no dead branch.

The policy (`dead_branches`, a builder option, applied by `calls.prepare` for builders and audit alike):
- "train" (default): nothing changes; the dead branch is its own trace, trained.
- "mask": the dead branch stays its own trace, masked (logprob 0.0), like any untrainable call.
- "drop": the dead branch is in no trace (counted under `skipped["dead_branch"]`); its retry then continues
  the conversation before it, so a retried session is one trace again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

from polar.store.records import CompletionRecord
from polar.trajectory.tokens import pack

DeadBranches = Literal["train", "mask", "drop"]
POLICIES: tuple[str, ...] = ("train", "mask", "drop")
RETRY, DEAD_BRANCH = "retry", "dead_branch"


def find_dead_branches(records: Sequence[CompletionRecord]) -> dict[str, str]:
    """{dead branch's completion id: the completion id of the next call with its prompt (its retry), or
    for the last of them, of the one that was used}.

    Among calls with one and the same server prompt, those whose turn (prompt ‖ sampled) a later call
    continues were used; when none was, the last one was (the session's final answer). The rest are dead.
    Two with the same sampled tokens (a greedy retry) cannot be told apart: the later one counts as used."""
    calls: list[tuple[CompletionRecord, bytes, bytes]] = []
    groups: dict[bytes, list[int]] = {}
    for r in sorted(records, key=lambda r: r.seq):
        prompt = pack(r.prompt_ids) if r.prompt_ids is not None else None
        if prompt is None:
            continue
        sampled = (pack(r.response_ids) or b"") if r.response_ids is not None else b""
        groups.setdefault(prompt, []).append(len(calls))
        calls.append((r, prompt, sampled))
    dead: dict[str, str] = {}
    for prompt, group in groups.items():
        if len(group) < 2:
            continue
        used: dict[bytes, int] = {}  # sampled -> the latest member with it that a later call continues
        for i in group:
            turn = prompt + calls[i][2]
            if any(p != prompt and p.startswith(turn) for _, p, _ in calls[i + 1 :]):
                used[calls[i][2]] = i
        kept = set(used.values()) or {group[-1]}
        for k, i in enumerate(group):
            if i not in kept:
                instead = group[k + 1] if k + 1 < len(group) else max(kept)
                dead[calls[i][0].completion_id] = calls[instead][0].completion_id
    return dead


def tag_retries(records: Sequence[CompletionRecord]) -> list[CompletionRecord]:
    """`records` with `dead_branch` on each dead branch and `retry` on the call that replaced it."""
    dead = find_dead_branches(records)
    if not dead:
        return list(records)
    retries = set(dead.values())
    out = []
    for r in records:
        tags = ((DEAD_BRANCH,) if r.completion_id in dead else ()) + (
            (RETRY,) if r.completion_id in retries else ()
        )
        out.append(replace(r, tags=tuple(dict.fromkeys((*r.tags, *tags)))) if tags else r)
    return out
