"""GRPO training pieces, each small enough to hold in one's head.

advantages  group-relative advantages (GRPO, RLOO, Dr. GRPO) over trajectories, one unit per session
loss        token-level PPO-clip (asymmetric), truncated importance sampling, k3 KL, aggregation modes
packing     several traces per row with per-trace attention, and their response-token logprobs
"""

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
