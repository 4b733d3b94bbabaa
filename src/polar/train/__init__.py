"""GRPO training pieces, each small enough to hold in one's head.

advantages  group-relative advantages (GRPO, RLOO, Dr. GRPO) over trajectories, one unit per session
loss        token-level PPO-clip (asymmetric), truncated importance sampling, k3 KL, aggregation modes
packing     several traces per row with per-trace attention, and their response-token logprobs

The names below are imported on first use, so the modules that need no torch (advantages, export: used by
`polar generate` and `polar traces export` on an install without the `engine` extra) import without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polar.train.advantages import (
        ESTIMATORS,
        Estimator,
        GroupStats,
        TraceAdvantage,
        group_advantages,
        trajectory_advantages,
    )
    from polar.train.loss import Aggregation, LossConfig, LossMetrics, policy_loss
    from polar.train.packing import (
        PackedBatch,
        Placement,
        block_causal_mask,
        pack,
        response_logits,
        response_logprobs,
        token_logprobs,
        unpack,
    )

_WHERE = {
    **dict.fromkeys(
        (
            "ESTIMATORS",
            "Estimator",
            "GroupStats",
            "TraceAdvantage",
            "group_advantages",
            "trajectory_advantages",
        ),
        "advantages",
    ),
    **dict.fromkeys(("Aggregation", "LossConfig", "LossMetrics", "policy_loss"), "loss"),
    **dict.fromkeys(
        (
            "PackedBatch",
            "Placement",
            "block_causal_mask",
            "pack",
            "response_logits",
            "response_logprobs",
            "token_logprobs",
            "unpack",
        ),
        "packing",
    ),
}

__all__ = [
    "ESTIMATORS",
    "Aggregation",
    "Estimator",
    "GroupStats",
    "LossConfig",
    "LossMetrics",
    "PackedBatch",
    "Placement",
    "TraceAdvantage",
    "block_causal_mask",
    "group_advantages",
    "pack",
    "policy_loss",
    "response_logits",
    "response_logprobs",
    "token_logprobs",
    "trajectory_advantages",
    "unpack",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'polar.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"polar.train.{module}"), name)
