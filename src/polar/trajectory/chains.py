"""Assigning calls to chains: the core of `prefix_merging`.

A call joins the chain whose tip (the last server prompt in it) is the longest strict token prefix of its
own prompt. The boundary between the chain's last turn (prompt p_i, sampled a_i) and the new call
(prompt p_{i+1}) is then *proved* on tokens:

- exact: p_{i+1}[len(p_i) : len(p_i)+len(a_i)] == a_i. The server re-rendered the sampled turn token for
  token, so p_i ‖ a_i ‖ p_{i+1}[len(p_i)+len(a_i):] == p_{i+1}: the merged sequence is exactly the context
  the policy saw. A `length`-truncated a_i is exact too; the end-of-turn token the template appends after
  it lands in the (masked) interstitial.
- drift: the re-rendering differs (Qwen3's template drops `<think>` from turns before the last user
  message; harnesses re-serialize tool-call arguments). Merging would show the trainer a context the policy
  never saw. By default the chain is split there (`on_drift="split"`); `on_drift="merge"` keeps the
  reference's behaviour and cuts the interstitial after the end-of-turn token that closes the re-rendered
  turn, and splits anyway when that token cannot be found (the boundary cannot be proved).

Sampled ids are never used to *find* a chain (BPE may re-tokenize them), only to check a boundary and to
break ties between identical tips (retries), where the chain whose turn reappears verbatim wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polar.trajectory.calls import Call
from polar.trajectory.tokens import ITEM, WINDOW, TipIndex, lcp, n_tokens, pack

# Why a chain starts. `root`: nothing it continues (first call, subagent, side call, changed system
# prompt); `retry`: same prompt as an earlier call (a sibling); the rest are breaks of a conversation.
ROOT, RETRY = "root", "retry"
CONTEXT_DRIFT, UNPROVABLE = "context_drift", "unprovable_boundary"
COMPACTION, REWRITE, TOOLS = "compaction", "history_rewrite", "tools_changed"
BREAKS = (CONTEXT_DRIFT, UNPROVABLE, COMPACTION, REWRITE, TOOLS)


@dataclass(frozen=True, slots=True)
class Turn:
    call: Call
    cut: int = 0  # interstitial before this turn = call's prompt_ids[cut:] (unused for a chain's first turn)
    drift: bool = False  # merged although the re-rendered previous turn differs from what was sampled


@dataclass(slots=True)
class Chain:
    index: int
    turns: list[Turn]
    started_by: str = ROOT
    sibling_of: int | None = None  # chain holding the earlier call with the same prompt
    retry_of: str | None = None  # that call's completion id
    split_from: str | None = None  # completion id of the turn before a drift split
    diverged_from: int | None = None  # chain this one breaks away from (drift split, compaction, rewrite)


@dataclass(frozen=True, slots=True)
class Assembly:
    chains: list[Chain]
    drift_turns: int  # boundaries whose re-rendering differs from the sampled tokens, merged or split
    drift_merged: int


def _find_token(packed: bytes, token: int, start: int) -> int:
    """Index (in tokens) of the first `token` at or after token index `start`, or -1."""
    needle = pack([token])
    if needle is None:
        return -1
    pos = packed.find(needle, start * ITEM)
    while pos != -1 and pos % ITEM:
        pos = packed.find(needle, pos + 1)
    return -1 if pos == -1 else pos // ITEM


def boundary(prev: Call, nxt: Call, eot: int | None) -> tuple[int | None, bool]:
    """(cut, drift) for `nxt` following `prev` in a chain: the interstitial is `nxt`'s prompt from `cut`.

    `cut` is None when drift leaves no end-of-turn token to cut at."""
    start = prev.n_prompt
    if nxt.prompt.startswith(prev.sampled, start * ITEM):
        return start + prev.n_sampled, False
    if eot is None:
        return None, True
    end = _find_token(nxt.prompt, eot, start)
    return (None if end == -1 else end + 1), True


def _system(call: Call) -> object:
    msgs = call.prompt_messages
    if msgs and isinstance(msgs[0], dict) and msgs[0].get("role") in ("system", "developer"):
        return msgs[0].get("content")
    return None


def _tools(call: Call) -> object:
    return call.record.tools


def _tools_changed(call: Call, chains: Sequence[Chain]) -> int | None:
    """The latest chain whose tip's messages `call`'s messages extend while its tool list differs: the
    harness loaded or dropped a tool (Claude Code's tool search adds the loaded one; Qwen Code 0.24.4's no longer
    changes `tools`)."""
    msgs = call.prompt_messages
    for chain in reversed(chains):
        tip = chain.turns[-1].call
        prev = tip.prompt_messages
        if prev and len(prev) < len(msgs) and _tools(tip) != _tools(call) and msgs[: len(prev)] == prev:
            return chain.index
    return None


def _diverged(call: Call, tips: TipIndex[int], chains: Sequence[Chain]) -> tuple[str, int | None]:
    """Why `call` continues no chain: a root, or a break of the chain whose history it shares most of.

    - extends a chain's last messages with another `tools` list: `tools_changed` (the tool list is
      rendered into the prompt, so the policy saw a different context: a new chain is inherent);
    - keeps that chain's whole first prompt but not its tip: the harness rewrote later history;
      `compaction` when the prompt is shorter than the tip, `history_rewrite` otherwise;
    - keeps only its system message, is shorter than its tip, and that chain is a conversation (several
      turns, or itself a continuation): `compaction` (Claude Code and Codex compact to system prompt + a
      summary of the work; one-shot side calls sharing a system prompt are not compactions of each other);
    - otherwise `root` (first call, subagent, side call, changed system prompt).
    A subagent that reuses its parent's system prompt and starts shorter reads as a compaction: tokens
    and messages alone cannot tell the two apart."""
    changed = _tools_changed(call, chains)
    if changed is not None:
        return TOOLS, changed
    scored = [(lcp(call.prompt, tip), key, n_tokens(tip)) for key, tip in tips.items()]
    kept = [(n, key, size) for n, key, size in scored if n >= chains[key].turns[0].call.n_prompt]
    if kept:
        _, key, size = max(kept)
        return (COMPACTION if call.n_prompt < size else REWRITE), key
    system = _system(call)
    if system is None:
        return ROOT, None
    compacted = [
        (n, key)
        for n, key, size in scored
        if call.n_prompt < size
        and (len(chains[key].turns) > 1 or chains[key].started_by != ROOT)
        and _system(chains[key].turns[0].call) == system
    ]
    return (COMPACTION, max(compacted)[1]) if compacted else (ROOT, None)


def assemble(calls: Sequence[Call], eot: int | None, merge_drift: bool) -> Assembly:
    """Place every call, in order, in exactly one chain (see module doc)."""
    tips: TipIndex[int] = TipIndex()
    seen: dict[tuple[int, bytes], list[int]] = {}  # (length, tail window) -> indices of calls
    chain_of: list[int] = []
    chains: list[Chain] = []
    drift_turns = drift_merged = 0

    def start(call: Call, started_by: str, **links: Any) -> None:
        chain = Chain(len(chains), [Turn(call)], started_by, **links)
        chains.append(chain)
        chain_of.append(chain.index)
        tips.set(chain.index, call.prompt)

    for i, call in enumerate(calls):
        key = (call.n_prompt, call.prompt[-WINDOW * ITEM :])
        same = seen.setdefault(key, [])
        twin = next((j for j in reversed(same) if calls[j].prompt == call.prompt), None)
        same.append(i)
        if twin is not None:
            start(call, RETRY, sibling_of=chain_of[twin], retry_of=calls[twin].record.completion_id)
            continue
        _, keys = tips.longest_strict_prefix(call.prompt)
        if not keys:
            cause, diverged = _diverged(call, tips, chains)
            start(call, cause, diverged_from=diverged)
            continue
        options = [(c, *boundary(chains[c].turns[-1].call, call, eot)) for c in keys]
        exact = [o for o in options if not o[2]]
        c, cut, drift = max(exact or options, key=lambda o: o[0])
        prev = chains[c].turns[-1].call
        if drift:
            drift_turns += 1
        if cut is not None and (not drift or merge_drift):
            drift_merged += drift
            chains[c].turns.append(Turn(call, cut, drift))
            chain_of.append(c)
            tips.set(c, call.prompt)
            continue
        cause = CONTEXT_DRIFT if not merge_drift else UNPROVABLE
        start(call, cause, split_from=prev.record.completion_id, diverged_from=c)
    return Assembly(chains, drift_turns, drift_merged)
