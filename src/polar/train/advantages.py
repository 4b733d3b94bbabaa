"""Group-relative advantages: GRPO, RLOO and Dr. GRPO over trajectories that may hold several traces.

A group is the samples of one task (trajectory metadata `group_id`, else `task_id`; the rollout node sets
both). For a group with rewards r_1..r_n, mean mu and sample std sigma (n - 1 in the denominator, as
verl and TRL compute it):

    grpo      A_i = (r_i - mu) / (sigma + eps)
    dr_grpo   A_i =  r_i - mu                        (no std division: Liu et al., "Dr. GRPO")
    rloo      A_i =  r_i - (sum_{j != i} r_j) / (n - 1)   =  n / (n - 1) * (r_i - mu)

A group whose rewards are all equal (or which has one sample) carries no learning signal: every advantage in
it is exactly 0 and the group is counted in `GroupStats.zero_variance_groups`, so a run can tell "the
policy learned nothing" from "there was nothing to learn".

Trajectories, not traces, are the samples. A session rebuilt as k traces (per_request, or prefix_merging
with breaks) shares its trajectory's baseline and counts as ONE unit: each trace gets weight 1/k (k = the
trajectory's traces with any trainable token), so splitting a session never pays its reward k times. A
trace whose own reward differs from its trajectory's (the fail-closed rules zero the reward of a trace with
an unparseable tool call) is scored against the same group baseline with its own reward (in a
zero-variance group it too gets 0: the group as a whole has no signal).

Masked trajectories (metadata `masked`: the session failed for reasons the policy does not own) are left out
of the group statistics and get advantage 0 and weight 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeGuard

from polar.trajectory.models import Trajectory

Estimator = Literal["grpo", "rloo", "dr_grpo"]
ESTIMATORS: tuple[Estimator, ...] = ("grpo", "rloo", "dr_grpo")


@dataclass(frozen=True, slots=True)
class GroupStats:
    groups: int  # groups with at least one unmasked sample
    zero_variance_groups: int  # of those, groups whose rewards are all equal (no gradient)
    zero_variance_group_ids: tuple[str, ...]
    samples: int  # unmasked trajectories (or rows)
    masked: int  # masked trajectories, left out of everything
    mean_reward: float  # over unmasked samples; 0.0 when there are none
    reward_std: float  # population std (n in the denominator) over the same samples; 0.0 when there are none
    pass_rate: float  # fraction of unmasked samples that passed; 0.0 when there are none


@dataclass(frozen=True, slots=True)
class TraceAdvantage:
    trajectory: int  # index of the trajectory in the input
    trace: int  # index of the trace in its trajectory
    group: str | None  # None for masked trajectories
    advantage: float
    weight: float  # 1 / (trainable traces of its trajectory); 0.0 when masked or nothing trainable


@dataclass(frozen=True, slots=True)
class _Baseline:
    """How one sample's reward becomes an advantage: A = (reward - center) / scale."""

    center: float
    scale: float
    zero: bool  # zero-variance group: every advantage is 0

    def __call__(self, reward: float) -> float:
        return 0.0 if self.zero else (reward - self.center) / self.scale


def _baselines(rewards: Sequence[float], estimator: Estimator, eps: float) -> list[_Baseline]:
    """One baseline per sample of a group (RLOO's differs per sample: it leaves that sample out)."""
    n = len(rewards)
    mu = sum(rewards) / n
    # Equal up to float noise (0.1 + 0.2 vs 0.3): GRPO would blow such a difference up to +-0.7.
    zero = n < 2 or math.isclose(max(rewards), min(rewards), rel_tol=1e-9, abs_tol=1e-12)
    if estimator == "grpo":
        sigma = math.sqrt(sum((r - mu) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
        return [_Baseline(mu, sigma + eps, zero)] * n
    if estimator == "dr_grpo":
        return [_Baseline(mu, 1.0, zero)] * n
    if estimator == "rloo":
        total = sum(rewards)
        return [_Baseline((total - r) / (n - 1) if n > 1 else r, 1.0, zero) for r in rewards]
    raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")


def _group(
    rows: Sequence[tuple[Hashable, float]], estimator: Estimator, eps: float
) -> tuple[list[_Baseline], list[str], list[str]]:
    """Baselines aligned with `rows`, the group key of each row, and the zero-variance group keys."""
    members: dict[str, list[int]] = defaultdict(list)
    keys = [str(g) for g, _ in rows]
    for i, key in enumerate(keys):
        members[key].append(i)
    out: list[_Baseline | None] = [None] * len(rows)
    zero_groups: list[str] = []
    for key, idx in members.items():
        bases = _baselines([rows[i][1] for i in idx], estimator, eps)
        if bases[0].zero:
            zero_groups.append(key)
        for i, b in zip(idx, bases, strict=True):
            out[i] = b
    return [b for b in out if b is not None], keys, zero_groups


def _finite(x: object) -> TypeGuard[float]:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _stats(
    rewards: Sequence[float], passed: Sequence[bool], groups: set[str], zero: list[str], masked: int
) -> GroupStats:
    n = len(rewards)
    mean = sum(rewards) / n if n else 0.0
    return GroupStats(
        groups=len(groups),
        zero_variance_groups=len(zero),
        zero_variance_group_ids=tuple(sorted(zero)),
        samples=n,
        masked=masked,
        mean_reward=mean,
        # Of the whole batch, not per group: how spread the rewards a step learned from were (the
        # per-group std that GRPO divides by is the sample std; this one describes the batch itself).
        reward_std=math.sqrt(sum((r - mean) ** 2 for r in rewards) / n) if n else 0.0,
        pass_rate=sum(passed) / n if n else 0.0,
    )


def group_advantages(
    rows: Sequence[tuple[Hashable, float]],
    estimator: Estimator = "grpo",
    *,
    eps: float = 1e-6,
    pass_threshold: float = 1.0,
) -> tuple[list[float], GroupStats]:
    """Advantages for plain (group, reward) rows, aligned with `rows`; a row passed if reward >= threshold."""
    for i, (_, r) in enumerate(rows):
        if not _finite(r):
            raise ValueError(f"rows[{i}]: reward must be a finite number, got {r!r}")
    bases, keys, zero = _group(rows, estimator, eps)
    rewards = [float(r) for _, r in rows]
    advantages = [b(r) for b, r in zip(bases, rewards, strict=True)]
    passed = [r >= pass_threshold for r in rewards]
    return advantages, _stats(rewards, passed, set(keys), zero, masked=0)


def _trajectory_reward(t: Trajectory, i: int) -> float:
    """The session's reward (`metadata["reward"]`), else the mean of its traces' rewards."""
    r = t.metadata.get("reward")
    if _finite(r):
        return float(r)
    trace_rewards = [tr.reward for tr in t.traces if _finite(tr.reward)]
    if trace_rewards and len(trace_rewards) == len(t.traces):
        return sum(trace_rewards) / len(trace_rewards)
    raise ValueError(f"trajectories[{i}]: no reward (metadata 'reward' or a reward on every trace)")


def _group_key(t: Trajectory, i: int) -> str:
    for name in ("group_id", "task_id"):
        key = t.metadata.get(name)
        if isinstance(key, str) and key:
            return key
    raise ValueError(f"trajectories[{i}]: no group (metadata 'group_id' or 'task_id')")


def _passed(t: Trajectory, reward: float, threshold: float) -> bool:
    evaluation = t.metadata.get("evaluation")
    if isinstance(evaluation, dict) and isinstance(evaluation.get("passed"), bool):
        return bool(evaluation["passed"])
    return reward >= threshold


def trajectory_advantages(
    trajectories: Sequence[Trajectory],
    estimator: Estimator = "grpo",
    *,
    eps: float = 1e-6,
    pass_threshold: float = 1.0,
) -> tuple[list[TraceAdvantage], GroupStats]:
    """One `TraceAdvantage` per trace of every trajectory, in input order (masked ones included, weight 0).

    A trajectory passed if its evaluation says so (`metadata["evaluation"]["passed"]`), else if its reward
    reaches `pass_threshold`.
    """
    live = [i for i, t in enumerate(trajectories) if not t.metadata.get("masked", False)]
    rows = [(_group_key(trajectories[i], i), _trajectory_reward(trajectories[i], i)) for i in live]
    bases, keys, zero = _group(rows, estimator, eps)
    by_index = {i: (b, key, r) for i, b, key, (_, r) in zip(live, bases, keys, rows, strict=True)}

    out: list[TraceAdvantage] = []
    for i, t in enumerate(trajectories):
        if i not in by_index:
            out.extend(TraceAdvantage(i, j, None, 0.0, 0.0) for j in range(len(t.traces)))
            continue
        base, key, session_reward = by_index[i]
        units = sum(1 for tr in t.traces if tr.trainable_tokens > 0)
        for j, tr in enumerate(t.traces):
            reward = float(tr.reward) if _finite(tr.reward) else session_reward
            weight = 1.0 / units if tr.trainable_tokens > 0 else 0.0
            out.append(TraceAdvantage(i, j, key, base(reward), weight))

    rewards = [r for _, r in rows]
    passed = [_passed(trajectories[i], r, pass_threshold) for i, (_, r) in zip(live, rows, strict=True)]
    return out, _stats(rewards, passed, set(keys), zero, masked=len(trajectories) - len(live))
