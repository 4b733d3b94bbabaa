"""Advantage math against hand-computed cases: GRPO, RLOO, Dr. GRPO, multi-trace sessions, masking, stats."""

from __future__ import annotations

import math
from typing import Any

import pytest

from polar.train.advantages import group_advantages, trajectory_advantages
from polar.trajectory import Trace, Trajectory


def trace(reward: float | None, mask: tuple[int, ...] = (1, 1)) -> Trace:
    n = len(mask)
    return Trace(
        prompt_ids=[1, 2],
        response_ids=list(range(3, 3 + n)),
        loss_mask=list(mask),
        response_logprobs=[-0.5 if m else 0.0 for m in mask],
        reward=reward,
    )


def session(task: str, reward: float, traces: int = 1, **meta: Any) -> Trajectory:
    return Trajectory(
        traces=[trace(reward) for _ in range(traces)],
        metadata={"task_id": task, "reward": reward, "masked": False, **meta},
    )


def test_grpo_uses_group_mean_and_sample_std() -> None:
    adv, stats = group_advantages([("a", 1.0), ("a", 0.0), ("a", 0.0), ("a", 1.0)], "grpo")
    # mean 0.5, sample std sqrt((4 * 0.25) / 3) = sqrt(1/3)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv == pytest.approx([expected, -expected, -expected, expected])
    assert stats.groups == 1 and stats.zero_variance_groups == 0
    assert stats.mean_reward == 0.5 and stats.pass_rate == 0.5


def test_reward_std_is_the_population_std_of_the_batchs_unmasked_rewards() -> None:
    # Two groups, one without variance: the batch's spread, not a group's (GRPO's sample std is 0.577 here).
    _, stats = group_advantages([("a", 1.0), ("a", 0.0), ("b", 1.0), ("b", 1.0)], "grpo")
    assert stats.mean_reward == 0.75 and stats.reward_std == pytest.approx(math.sqrt(0.75 * 0.25))
    masked = Trajectory(traces=[trace(0.0)], metadata={"task_id": "t", "reward": 0.0, "masked": True})
    _, stats = trajectory_advantages([session("t", 1.0), masked, session("t", 0.5)])
    assert stats.reward_std == pytest.approx(0.25)  # the masked 0 is left out: rewards 1.0 and 0.5
    _, same = group_advantages([("a", 0.5), ("a", 0.5)])
    assert same.reward_std == 0.0


def test_rloo_leaves_each_sample_out_of_its_baseline() -> None:
    adv, _ = group_advantages([("a", 1.0), ("a", 0.0), ("a", 0.5)], "rloo")
    # 1 - (0 + 0.5)/2, 0 - (1 + 0.5)/2, 0.5 - (1 + 0)/2
    assert adv == pytest.approx([0.75, -0.75, 0.0])


def test_dr_grpo_centres_without_dividing_by_std() -> None:
    adv, _ = group_advantages([("a", 1.0), ("a", 0.0), ("a", 0.0)], "dr_grpo")
    assert adv == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_groups_are_independent_and_zero_variance_groups_are_reported() -> None:
    rows = [("a", 1.0), ("b", 1.0), ("a", 0.0), ("b", 1.0), ("c", 0.3)]
    adv, stats = group_advantages(rows, "dr_grpo")
    assert adv == [0.5, 0.0, -0.5, 0.0, 0.0]
    assert stats.groups == 3
    assert stats.zero_variance_groups == 2  # b: all equal; c: one sample, no baseline
    assert stats.zero_variance_group_ids == ("b", "c")
    assert stats.samples == 5 and stats.pass_rate == pytest.approx(3 / 5)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_zero_variance_group_gives_exactly_zero(estimator: str) -> None:
    adv, stats = group_advantages([("a", 0.7), ("a", 0.7), ("a", 0.7)], estimator)  # type: ignore[arg-type]
    assert adv == [0.0, 0.0, 0.0]
    assert stats.zero_variance_groups == 1


def test_rewards_equal_up_to_float_noise_are_zero_variance() -> None:
    adv, stats = group_advantages([("a", 0.1 + 0.2), ("a", 0.3)], "grpo")
    assert adv == [0.0, 0.0] and stats.zero_variance_groups == 1


def test_bad_rows_and_estimator_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"rows\[1\]: reward must be a finite number"):
        group_advantages([("a", 1.0), ("a", float("nan"))])
    with pytest.raises(ValueError, match="estimator must be one of grpo, rloo, dr_grpo"):
        group_advantages([("a", 1.0)], "ppo")  # type: ignore[arg-type]


def test_traces_of_a_session_share_its_advantage_and_count_as_one_unit() -> None:
    trajectories = [session("t", 1.0, traces=3), session("t", 0.0, traces=1)]
    out, stats = trajectory_advantages(trajectories, "rloo")
    assert [(a.trajectory, a.trace) for a in out] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert [a.advantage for a in out] == [1.0, 1.0, 1.0, -1.0]
    assert [a.weight for a in out] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0])
    assert stats.samples == 2 and stats.groups == 1  # sessions, not traces, are the samples


def test_a_split_session_is_not_paid_more_than_a_merged_one() -> None:
    split = trajectory_advantages([session("t", 1.0, traces=4), session("t", 0.0)], "grpo")[0]
    merged = trajectory_advantages([session("t", 1.0, traces=1), session("t", 0.0)], "grpo")[0]
    paid_split = sum(a.advantage * a.weight for a in split if a.trajectory == 0)
    paid_merged = sum(a.advantage * a.weight for a in merged if a.trajectory == 0)
    assert paid_split == pytest.approx(paid_merged)


def test_untrainable_trace_has_no_weight_and_does_not_dilute_the_others() -> None:
    t = Trajectory(
        traces=[trace(1.0), trace(1.0, mask=(0, 0)), trace(1.0)],
        metadata={"task_id": "t", "reward": 1.0},
    )
    out, _ = trajectory_advantages([t, session("t", 0.0)], "dr_grpo")
    assert [a.weight for a in out[:3]] == [0.5, 0.0, 0.5]


def test_trace_with_its_own_reward_is_scored_against_the_group_baseline() -> None:
    # The fail-closed rules zero the reward of a trace whose tool call did not parse.
    t = Trajectory(traces=[trace(1.0), trace(0.0)], metadata={"task_id": "t", "reward": 1.0})
    out, _ = trajectory_advantages([t, session("t", 0.0), session("t", 0.0)], "rloo")
    # baseline for the session: (0 + 0) / 2 = 0
    assert [a.advantage for a in out[:2]] == [1.0, 0.0]


def test_masked_sessions_are_left_out_of_baselines_and_stats() -> None:
    masked = Trajectory(
        traces=[trace(0.0, mask=(0, 0))], metadata={"task_id": "t", "reward": 0.0, "masked": True}
    )
    trajectories = [session("t", 1.0), masked, session("t", 0.0)]
    out, stats = trajectory_advantages(trajectories, "rloo")
    # With the masked zero counted, the first baseline would be 0 and the third 0.5.
    assert [(a.advantage, a.weight, a.group) for a in out] == [
        (1.0, 1.0, "t"),
        (0.0, 0.0, None),
        (-1.0, 1.0, "t"),
    ]
    assert stats.masked == 1 and stats.samples == 2
    assert stats.mean_reward == 0.5


def test_group_id_takes_precedence_over_task_id() -> None:
    trajectories = [
        session("t1", 1.0, group_id="g"),
        session("t2", 0.0, group_id="g"),
        session("t3", 0.0),
    ]
    out, stats = trajectory_advantages(trajectories, "dr_grpo")
    assert [a.group for a in out] == ["g", "g", "t3"]
    assert [a.advantage for a in out] == [0.5, -0.5, 0.0]
    assert stats.groups == 2 and stats.zero_variance_group_ids == ("t3",)


def test_reward_falls_back_to_the_mean_of_trace_rewards() -> None:
    t = Trajectory(traces=[trace(1.0), trace(0.0)], metadata={"task_id": "t", "reward": None})
    out, stats = trajectory_advantages([t, session("t", 0.0)], "dr_grpo")
    # session reward 0.5, group mean 0.25; each trace is scored with its own reward
    assert [a.advantage for a in out] == [0.75, -0.25, -0.25]
    assert stats.mean_reward == 0.25


def test_pass_rate_uses_the_evaluation_verdict_when_present() -> None:
    trajectories = [
        session("t", 0.4, evaluation={"passed": True, "details": {}}),
        session("t", 1.0, evaluation={"passed": False, "details": {}}),
        session("t", 1.0),  # no verdict: reward >= pass_threshold
    ]
    _, stats = trajectory_advantages(trajectories)
    assert stats.pass_rate == pytest.approx(2 / 3)


def test_sessions_without_group_or_reward_are_rejected() -> None:
    no_group = Trajectory(traces=[trace(1.0)], metadata={"reward": 1.0})
    with pytest.raises(ValueError, match=r"trajectories\[0\]: no group"):
        trajectory_advantages([no_group])
    no_reward = Trajectory(traces=[trace(None)], metadata={"task_id": "t"})
    with pytest.raises(ValueError, match=r"trajectories\[1\]: no reward"):
        trajectory_advantages([session("t", 1.0), no_reward])


def test_empty_input_gives_empty_stats() -> None:
    out, stats = trajectory_advantages([])
    assert out == [] and stats.groups == 0 and stats.mean_reward == 0.0 and stats.pass_rate == 0.0
    assert stats.reward_std == 0.0
