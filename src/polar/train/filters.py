"""Which finished groups a step trains on, and what an overlong answer earns.

Dynamic sampling (DAPO, Yu et al. 2025): a group whose samples all earned the same reward has advantage 0
everywhere, so it fills a batch slot and moves nothing; a group whose every session failed for reasons that
are not the policy's (all masked) has nothing to train on at all. `GroupFilter` names such a group, and the
loop (`polar.train.loop`) leaves it out and takes the next finished group instead, so each step still trains
on `batch_groups` informative groups, up to a cap on groups taken per step (past it the step fills up with
the groups it left out, and says so, rather than wait forever on a task set the policy always fails).

Overlong answers: an answer cut by the token limit (`finish_reason: length`) is not the policy's choice to
stop, so training on its reward as if it were teaches noise (DAPO's "overlong filtering"); `Overlong` masks
such sessions (`mask`) or gives every answer a soft length penalty (`penalty`, DAPO's overlong reward
shaping): 0 up to `max_tokens - buffer` tokens, then falling linearly to -`penalty_factor` at `max_tokens`,
and -`penalty_factor` past it. An answer is one sampled turn (`turn_offsets` in a trace's metadata, written by
the builders; a trace without them counts its longest run of sampled tokens), the length that `max_tokens`
bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from polar.train.advantages import Estimator, trajectory_advantages
from polar.trajectory.models import Trace, Trajectory

OverlongMode = Literal["keep", "mask", "penalty"]
FilterReason = Literal["zero_variance", "all_masked"]


@dataclass(frozen=True, slots=True)
class GroupFilter:
    zero_variance: bool = False  # leave out groups whose advantages are all 0
    all_masked: bool = False  # leave out groups with no unmasked sample
    max_groups: int | None = None  # groups a step may take, kept and left out; None: no filtering cap

    @property
    def active(self) -> bool:
        return self.zero_variance or self.all_masked

    def reason(self, trajectories: Sequence[Trajectory], estimator: Estimator) -> FilterReason | None:
        """Why a group's `trajectories` (after overlong shaping) carry no gradient, or None if they do.

        Zero variance is judged on the advantages the step would compute (polar.train.advantages), not on
        rewards alone: the step trains on exactly the groups this keeps, and on nothing this leaves out."""
        live = [t for t in trajectories if not t.metadata.get("masked", False)]
        if not live:
            return "all_masked" if self.all_masked else None
        if not self.zero_variance:
            return None
        advantages, _ = trajectory_advantages(live, estimator)
        if all(a.advantage == 0.0 or a.weight == 0.0 for a in advantages):
            return "zero_variance"
        return None


@dataclass(frozen=True, slots=True)
class Overlong:
    mode: OverlongMode = "keep"
    max_tokens: int | None = None  # penalty: the answer length the penalty reaches -penalty_factor at
    buffer: int = 0  # penalty: tokens before max_tokens over which the penalty ramps down from 0
    penalty_factor: float = 1.0

    def apply(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
        """The trajectories as the step should see them, and how many were masked or penalized."""
        if self.mode == "keep":
            return list(trajectories), 0
        out: list[Trajectory] = []
        touched = 0
        for t in trajectories:
            if t.metadata.get("masked", False):
                out.append(t)
                continue
            if self.mode == "mask":
                if cut(t):
                    t = t.model_copy(update={"metadata": {**t.metadata, "masked": True, "overlong": True}})
                    touched += 1
            else:
                assert self.max_tokens is not None  # the config requires it for `penalty`
                p = self.penalty_factor * length_penalty(answer_length(t), self.max_tokens, self.buffer)
                if p != 0.0:
                    t = _penalized(t, p)
                    touched += 1
            out.append(t)
        return out, touched


def cut(t: Trajectory) -> bool:
    """Whether any of the session's traces ended on an answer cut by the token limit."""
    return any(tr.finish_reason == "length" for tr in t.traces)


def answer_length(t: Trajectory) -> int:
    """The longest single answer the policy sampled in the session, in tokens."""
    return max((_answer_length(tr) for tr in t.traces), default=0)


def _answer_length(tr: Trace) -> int:
    mask = tr.loss_mask
    offsets = tr.metadata.get("turn_offsets")
    if isinstance(offsets, list) and offsets and all(isinstance(o, int) for o in offsets):
        starts: Sequence[int] = offsets
    else:  # a custom builder's trace: every run of sampled tokens
        starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    longest = 0
    for s in starts:
        end = s
        while end < len(mask) and mask[end]:
            end += 1
        longest = max(longest, end - s)
    return longest


def length_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment, in [-1, 0]."""
    if length >= max_tokens:
        return -1.0
    start = max_tokens - buffer
    if buffer <= 0 or length <= start:
        return 0.0
    return (start - length) / buffer


def _penalized(t: Trajectory, penalty: float) -> Trajectory:
    """`t` with `penalty` added to its reward and to each trace's own reward (the advantages read both)."""
    meta = dict(t.metadata)
    reward = meta.get("reward")
    if isinstance(reward, int | float) and math.isfinite(reward):
        meta["reward"] = float(reward) + penalty
    meta["overlong_penalty"] = penalty
    traces = [
        tr.model_copy(update={"reward": float(tr.reward) + penalty})
        if isinstance(tr.reward, int | float) and math.isfinite(tr.reward)
        else tr
        for tr in t.traces
    ]
    return t.model_copy(update={"metadata": meta, "traces": traces})
