"""Invariants every session must satisfy, as one reusable check.

`check_session(records)` is the hook for any source of records: hand-made ones, the real-template
generator in `test_trajectory_template`, and sessions captured through the gateway from real harness
requests (pass `expected_chains` to pin how they must merge). It builds every strategy, audits each, and
checks the invariants independently of the audit, from the records alone where it can.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar.store.records import CompletionRecord
from polar.trajectory import Trajectory, audit, build
from polar.trajectory.calls import eligible
from tests.test_trajectory_rules import rec


def _trainable_tokens(t: Trajectory) -> Counter[tuple[int, float]]:
    out: Counter[tuple[int, float]] = Counter()
    for tr in t.traces:
        lps = tr.response_logprobs or [0.0] * len(tr.response_ids)
        out.update((tok, lp) for tok, m, lp in zip(tr.response_ids, tr.loss_mask, lps, strict=True) if m)
    return out


def check_session(
    records: Sequence[CompletionRecord], expected_chains: list[list[str]] | None = None
) -> dict[str, Trajectory]:
    """Build `records` with every strategy and assert the invariants; returns the trajectories by name."""
    built = {
        "per_request": build(records, "per_request"),
        "split": build(records, "prefix_merging"),
        "merge": build(records, "prefix_merging", on_drift="merge"),
    }
    by_id = {r.completion_id: r for r in records}
    # What the servers sampled, with logprobs, over the calls whose data makes them trainable.
    sampled: Counter[tuple[int, float]] = Counter()
    for r in records:
        if eligible(r) and r.prompt_ids is not None and r.response_ids is not None:
            sampled.update(zip(r.response_ids, r.response_logprobs or (), strict=True))
    for name, t in built.items():
        report = audit(t, records)
        assert report.ok, (name, report.errors)
        assert t.metadata["coverage"] == 1.0 == report.coverage, name
        # Same sampled tokens, same logprobs, each exactly once, whatever the strategy.
        assert _trainable_tokens(t) == sampled, name
        assert sum(len(tr.metadata["completion_ids"]) for tr in t.traces) + sum(
            t.metadata["skipped"].values()
        ) == len(records)
    # Split on drift: each trace is, token for token, its last call's server prompt + what it sampled, and
    # every earlier turn saw exactly the server's prompt.
    split = built["split"]
    for tr in split.traces:
        last = by_id[tr.metadata["completion_ids"][-1]]
        tail = last.response_ids if last.response_ids is not None else []
        assert tr.prompt_ids + tr.response_ids == (last.prompt_ids or []) + tail
    report = audit(split, records)
    assert report.exact_turns == report.turns
    assert all(not d.merged for d in report.drift)
    # Every drift the build counted is one the audit finds from the tokens, merged or split.
    for t in (split, built["merge"]):
        drift = audit(t, records).drift
        assert len(drift) == t.metadata["drift_turns"]
        assert sum(d.merged for d in drift) == t.metadata["drift_merged"]
    if expected_chains is not None:
        assert [tr.metadata["completion_ids"] for tr in split.traces] == expected_chains
    return built


# Token-level random sessions: cheap, so they explore many shapes (the real-template ones cost a tokenizer).
@st.composite
def token_sessions(draw: st.DrawFn) -> list[CompletionRecord]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    actions = draw(st.lists(st.sampled_from("ccccrdbnku"), min_size=1, max_size=20))
    agents: list[list[int]] = [[1, 50, 51, 9]]
    records: list[CompletionRecord] = []
    for a in actions:
        k = rng.randrange(len(agents))
        ctx = agents[k]
        prompt = [*ctx, 7]
        sampled = [rng.randrange(20, 40) for _ in range(rng.randint(0, 4))]
        if a != "k":
            sampled.append(2)  # "k": truncated, no end-of-turn
        kw = {"logprobs": a != "u"}
        records.append(rec(len(records), prompt, sampled, finish="length" if a == "k" else "stop", **kw))
        if a == "r":  # retry: same prompt again
            records.append(rec(len(records), prompt, [*sampled[:-1], 33, 2]))
        rendered = sampled if sampled[-1:] == [2] else [*sampled, 2]
        if a == "d":  # the next prompt re-renders the turn differently
            rendered = rendered[1:]
        agents[k] = [*prompt, *rendered, 9, 1, rng.randrange(60, 70), 2, 9]
        if a == "b":  # a subagent / side call with its own system prompt
            agents.append([1, rng.randrange(80, 90), 9])
        if a == "n":  # compaction: keep the system prompt, drop the history
            agents[k] = [*agents[k][:2], rng.randrange(91, 99), 9]
    return records


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_sessions())
def test_invariants_on_token_level_sessions(records: list[CompletionRecord]) -> None:
    check_session(records)


def test_check_session_pins_expected_chains() -> None:
    records = [rec(0, [1, 5, 7], [20, 2]), rec(1, [1, 5, 7, 20, 2, 9, 7], [21, 2]), rec(2, [1, 6, 7], [2])]
    check_session(records, expected_chains=[["c0", "c1"], ["c2"]])
