"""Each reconstruction rule on hand-made token lists (token 2 plays <|im_end|>, 9 the newline after it)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from polar.store.records import FLAG_NO_LOGPROBS, FLAG_NO_PROMPT_IDS, FLAG_NOT_TRAINABLE, CompletionRecord
from polar.trajectory import BuildError, Trajectory, audit, build
from polar.trajectory.retries import DEAD_BRANCH, RETRY, find_dead_branches, tag_retries

EOT = 2


def rec(
    seq: int,
    prompt: list[int] | None,
    sampled: list[int] | None,
    *,
    finish: str = "stop",
    logprobs: bool = True,
    flags: tuple[str, ...] = (),
    system: str | None = None,
    session: str = "s",
    policy_version: int | None = None,
) -> CompletionRecord:
    messages: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
    return CompletionRecord(
        session_id=session,
        seq=seq,
        completion_id=f"c{seq}",
        dialect="chat",
        created_at=float(seq),
        request={},
        upstream_request={"messages": messages},
        prompt_ids=prompt,
        response_ids=sampled,
        response_logprobs=[-(seq + 1) - i / 10 for i in range(len(sampled))]
        if logprobs and sampled
        else None,
        finish_reason=finish,
        response_message={"role": "assistant", "content": f"turn {seq}"},
        tools=None,
        usage={},
        model_requested="m",
        model_served="m",
        policy_version=policy_version,
        flags=flags,
    )


def chains(t: Trajectory) -> list[list[str]]:
    return [tr.metadata["completion_ids"] for tr in t.traces]


def checked(records: list[CompletionRecord], strategy: str = "prefix_merging", **options: Any) -> Trajectory:
    t = build(records, strategy, **options)
    report = audit(t, records)
    assert report.ok, report.errors
    assert t.metadata["coverage"] == 1.0
    return t


P1 = [1, 5, 6, 7]  # system + user + generation prompt
A1 = [20, 21, EOT]  # sampled, closed by the end-of-turn token
U1 = [9, 1, 30, 31, EOT, 9, 1, 7]  # newline, tool result, next generation prompt
P2 = P1 + A1 + U1
A2 = [22, EOT]


def test_a_call_that_extends_the_tip_merges_with_exact_interstitial() -> None:
    t = checked([rec(0, P1, A1), rec(1, P2, A2)])
    (tr,) = t.traces
    assert tr.prompt_ids == P1
    assert tr.response_ids == A1 + U1 + A2
    assert tr.loss_mask == [1, 1, 1] + [0] * len(U1) + [1, 1]
    assert tr.response_logprobs == [-1.0, -1.1, -1.2] + [0.0] * len(U1) + [-2.0, -2.1]
    assert tr.metadata["turn_offsets"] == [0, len(A1 + U1)]
    # The merged sequence up to turn 2 is exactly what the server rendered for call 2.
    assert tr.prompt_ids + tr.response_ids[: tr.metadata["turn_offsets"][1]] == P2
    assert t.metadata["merged_calls"] == 1 and t.metadata["drift_turns"] == 0


def test_truncated_turn_merges_with_the_template_end_of_turn_masked() -> None:
    a1 = [20, 21]  # cut by max_tokens: no end-of-turn token sampled
    p2 = P1 + a1 + [EOT] + U1  # the harness's template closes the turn
    (tr,) = checked([rec(0, P1, a1, finish="length"), rec(1, p2, A2)]).traces
    assert tr.response_ids == [*a1, EOT, *U1, *A2]
    assert tr.loss_mask[:3] == [1, 1, 0]


def test_longest_tip_wins() -> None:
    records = [rec(0, [1, 5, 6], [EOT]), rec(1, [1, 5], [EOT]), rec(2, [1, 5, 6, EOT, 9, 7], [EOT])]
    t = checked(records)
    assert chains(t) == [["c0", "c2"], ["c1"]]


def test_different_system_prompt_starts_a_root() -> None:
    t = checked([rec(0, P1, A1), rec(1, [1, 8, 8, 7], [3, EOT]), rec(2, P2, A2)])
    assert chains(t) == [["c0", "c2"], ["c1"]]
    assert t.metadata["roots"] == 2 and t.metadata["breaks"] == {}


def test_identical_prompt_is_a_sibling_and_the_verbatim_turn_picks_the_chain() -> None:
    a1b = [23, EOT]
    p2 = P1 + a1b + U1  # the harness kept the retry's answer
    t = checked([rec(0, P1, A1), rec(1, P1, a1b), rec(2, p2, A2)])
    assert chains(t) == [["c0"], ["c1", "c2"]]
    sibling = t.traces[1].metadata
    assert sibling["started_by"] == "retry" and sibling["sibling_of"] == 0 and sibling["retry_of"] == "c0"
    assert t.metadata["siblings"] == 1
    # Kept the first answer instead: the first chain continues.
    t = checked([rec(0, P1, A1), rec(1, P1, a1b), rec(2, P2, A2)])
    assert chains(t) == [["c0", "c2"], ["c1"]]


def test_drift_splits_by_default() -> None:
    p2 = [*P1, 21, EOT, *U1]  # the re-rendering dropped a token the policy sampled
    t = checked([rec(0, P1, A1), rec(1, p2, A2)])
    assert chains(t) == [["c0"], ["c1"]]
    assert t.metadata["breaks"] == {"context_drift": 1} and t.metadata["drift_turns"] == 1
    assert t.traces[1].metadata["split_from"] == "c0"
    (drift,) = audit(t, [rec(0, P1, A1), rec(1, p2, A2)]).drift
    assert (drift.completion_id, drift.next_completion_id, drift.merged) == ("c0", "c1", False)
    assert (drift.diverges_at, drift.sampled_tokens, drift.rendered_tokens) == (0, 3, 2)


def test_drift_merge_cuts_the_interstitial_after_the_end_of_turn_token() -> None:
    p2 = [*P1, 21, EOT, *U1]
    records = [rec(0, P1, A1), rec(1, p2, A2)]
    t = checked(records, on_drift="merge")
    (tr,) = t.traces
    assert tr.response_ids == A1 + U1 + A2
    assert tr.metadata["drift_turns"] == [1]
    assert t.metadata["drift_merged"] == 1
    (drift,) = audit(t, records).drift
    assert drift.merged


def test_drift_merge_without_an_end_of_turn_token_cannot_prove_the_boundary() -> None:
    p2 = [*P1, 21, 9, 1, 30, 31, 9, 1, 7]  # no end-of-turn token anywhere after the previous prompt
    t = checked([rec(0, P1, A1), rec(1, p2, A2)], on_drift="merge")
    assert chains(t) == [["c0"], ["c1"]]
    assert t.metadata["breaks"] == {"unprovable_boundary": 1}


def test_end_of_turn_is_inferred_from_stopped_calls_or_configured() -> None:
    records = [rec(0, P1, [20, 4]), rec(1, [1, 8, 7], [21, 4]), rec(2, [1, 9, 7], [22, EOT], finish="length")]
    assert build(records).metadata["eot_id"] == 4
    assert build(records, eot_id=EOT).metadata["eot_id"] == EOT
    # Configured end-of-turn token decides where a drifted interstitial is cut.
    p2 = [*P1, 21, 4, 7, EOT, 9, 1, 7]
    t = checked([rec(0, P1, A1), rec(1, p2, A2)], on_drift="merge", eot_id=4)
    assert t.traces[0].response_ids == [*A1, 7, EOT, 9, 1, 7, *A2]


def test_compaction_and_history_rewrite_are_breaks_with_causes() -> None:
    p3 = P2 + A2 + [9, 1, 40, EOT, 9, 1, 7]
    compacted = [*P1[:-1], 50, 51, 7]  # same system prompt, history replaced by a summary
    rewritten = [*P2[:-3], 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 7]  # keeps the first prompt
    records = [
        rec(0, P1, A1, system="agent"),
        rec(1, P2, A2, system="agent"),
        rec(2, p3, [24, EOT], system="agent"),
        rec(3, compacted, [25, EOT], system="agent"),
        rec(4, rewritten, [26, EOT], system="agent"),
    ]
    t = checked(records)
    assert chains(t) == [["c0", "c1", "c2"], ["c3"], ["c4"]]
    assert [tr.metadata["started_by"] for tr in t.traces] == ["root", "compaction", "history_rewrite"]
    assert t.metadata["breaks"] == {"compaction": 1, "history_rewrite": 1}
    # A one-shot call with the same system prompt as another one-shot is a root, not a compaction.
    t = checked([rec(0, [1, 5, 6, 6, 7], [EOT], system="side"), rec(1, [1, 5, 8, 7], [EOT], system="side")])
    assert [tr.metadata["started_by"] for tr in t.traces] == ["root", "root"]


def test_a_changed_tool_list_is_a_break_with_its_own_cause() -> None:
    """A tool search adds the loaded tool to `tools` (Claude Code 2.1.197, Qwen Code 0.15.10): the messages
    go on, but the tool list rendered before them changed, so no prompt extends the last one."""
    bash = {"type": "function", "function": {"name": "bash", "parameters": {}}}
    task = {"type": "function", "function": {"name": "task_create", "parameters": {}}}
    history = [{"role": "system", "content": "agent"}, {"role": "user", "content": "go"}]
    turn = [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "content": "loaded"}]

    def call(seq: int, prompt: list[int], sampled: list[int], msgs: list[Any], tools: list[Any]) -> Any:
        return replace(rec(seq, prompt, sampled), upstream_request={"messages": msgs}, tools=tools)

    searched = [1, 5, 30, 6, 7, *A1, *U1]  # the new tool's definition lands inside the first prompt
    records = [
        call(0, P1, A1, history, [bash]),
        call(1, searched, A2, history + turn, [bash, task]),
        call(2, [*searched, *A2, 9, 1, 7], [23, EOT], [*history, *turn, *turn], [bash, task]),
    ]
    t = checked(records)
    assert chains(t) == [["c0"], ["c1", "c2"]]
    assert [tr.metadata["started_by"] for tr in t.traces] == ["root", "tools_changed"]
    assert t.metadata["breaks"] == {"tools_changed": 1}
    # The same tool list on a call that continues no chain is not a tool change.
    records[1] = call(1, searched, A2, history + turn, [bash])
    assert checked(records[:2]).metadata["breaks"] == {}


def test_missing_logprobs_are_masked_unless_the_build_trains_without_them() -> None:
    flags = (FLAG_NO_LOGPROBS, FLAG_NOT_TRAINABLE)
    records = [rec(0, P1, A1, logprobs=False, flags=flags), rec(1, P2, A2)]
    t = checked(records)
    (tr,) = t.traces
    assert tr.loss_mask == [0, 0, 0] + [0] * len(U1) + [1, 1]
    assert tr.response_logprobs is not None and tr.response_logprobs[:3] == [0.0, 0.0, 0.0]
    assert t.metadata["sampled_tokens"] == 2 and t.metadata["untrainable_tokens"] == 3
    t = checked(records, train_without_logprobs=True)
    (tr,) = t.traces
    assert tr.loss_mask[:3] == [1, 1, 1] and tr.response_logprobs is None
    assert t.metadata["sampled_tokens"] == 5
    # Other defects stay untrainable even then.
    flagged = [rec(0, P1, A1, flags=(FLAG_NOT_TRAINABLE, "logprob_count_mismatch"), logprobs=False)]
    assert checked(flagged, train_without_logprobs=True).traces[0].loss_mask == [0, 0, 0]


def test_calls_without_token_data() -> None:
    records = [
        rec(0, P1, None, flags=("missing_response_ids", FLAG_NOT_TRAINABLE)),
        rec(1, P2, A2),
        rec(2, None, [5, EOT], flags=(FLAG_NO_PROMPT_IDS, FLAG_NOT_TRAINABLE)),
        rec(3, [1, 5, -1], [EOT]),
    ]
    t = checked(records)
    (tr,) = t.traces
    # Without the sampled ids the server's re-rendering of the turn is the (masked) context: still exact.
    assert tr.response_ids == A1 + U1 + A2 and tr.loss_mask == [0] * len(A1 + U1) + [1, 1]
    assert t.metadata["skipped"] == {"missing_prompt_ids": 1, "invalid_prompt_ids": 1}
    assert t.metadata["calls"] == 4 and t.metadata["untrainable_tokens"] == 3


def test_per_request_is_one_trace_per_call_with_every_sampled_token() -> None:
    records = [rec(0, P1, A1), rec(1, P2, A2), rec(2, P1, [3, EOT])]
    t = checked(records, "per_request")
    assert [(tr.prompt_ids, tr.response_ids) for tr in t.traces] == [
        (r.prompt_ids, r.response_ids) for r in records
    ]
    assert all(tr.loss_mask == [1] * len(tr.response_ids) for tr in t.traces)
    assert t.metadata["trainer_tokens"] == sum(
        len(r.prompt_ids or ()) + len(r.response_ids or ()) for r in records
    )


def test_policy_version_is_the_oldest_in_the_trace() -> None:
    t = checked([rec(0, P1, A1, policy_version=3), rec(1, P2, A2, policy_version=4)])
    assert t.traces[0].metadata["policy_version"] == 3
    assert t.traces[0].metadata["policy_versions"] == [3, 4]


def test_records_are_taken_in_seq_order() -> None:
    t = checked([rec(1, P2, A2), rec(0, P1, A1)])
    assert chains(t) == [["c0", "c1"]]


@pytest.mark.parametrize("strategy", ["per_request", "prefix_merging"])
def test_empty_session(strategy: str) -> None:
    t = checked([], strategy)
    assert t.traces == [] and t.metadata["calls"] == 0 and t.metadata["coverage"] == 1.0


# -- retries' dead branches (polar.trajectory.retries) ------------------------------------------------------

A1_CUT = [20, 21]  # cut by `length`: the harness drops it and sends the same prompt again


def retried() -> list[CompletionRecord]:
    """c0's answer is used; c1 is cut and dropped, c2 resends c1's prompt, c3 continues c2."""
    a2b = [24, EOT]
    return [
        rec(0, P1, A1),
        rec(1, P2, A1_CUT, finish="length"),
        rec(2, P2, a2b),
        rec(3, P2 + a2b + U1, A2),
    ]


def test_a_retried_call_is_a_dead_branch_trained_masked_or_dropped() -> None:
    records = retried()
    assert find_dead_branches(records) == {"c1": "c2"}
    assert [r.tags for r in tag_retries(records)] == [(), (DEAD_BRANCH,), (RETRY,), ()]
    t = checked(records)  # "train": today's build, the retry starts a trace of its own
    assert chains(t) == [["c0", "c1"], ["c2", "c3"]]
    t = checked(records, dead_branches="mask")
    assert chains(t) == [["c0", "c1"], ["c2", "c3"]]
    assert t.traces[0].loss_mask[-len(A1_CUT) :] == [0, 0]
    t = checked(records, dead_branches="drop")
    assert chains(t) == [["c0", "c2", "c3"]]
    assert t.metadata["skipped"] == {"dead_branch": 1} and t.metadata["options"]["dead_branches"] == "drop"
    with pytest.raises(BuildError, match="dead_branches must be one of train, mask, drop"):
        build(records, "prefix_merging", dead_branches="keep")


def test_which_of_identical_prompts_is_dead() -> None:
    a1b = [23, EOT]
    # The harness kept the first answer: the retry is the dead one.
    assert find_dead_branches([rec(0, P1, A1), rec(1, P1, a1b), rec(2, P2, A2)]) == {"c1": "c0"}
    # Nothing continues either (the session ended): the last answer is the one the harness kept.
    assert find_dead_branches([rec(0, P1, A1), rec(1, P1, a1b)]) == {"c0": "c1"}
    # The same answer twice: the later one counts as used.
    assert find_dead_branches([rec(0, P1, A1), rec(1, P1, A1), rec(2, P2, A2)]) == {"c0": "c1"}
    # No prompt seen twice: nothing is dead, whatever was not continued.
    assert find_dead_branches([rec(0, P1, A1), rec(1, P2, A2)]) == {}
    t = checked([rec(0, P1, A1), rec(1, P1, a1b), rec(2, P2, A2)], "per_request", dead_branches="drop")
    assert chains(t) == [["c0"], ["c2"]]
