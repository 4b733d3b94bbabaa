"""`per_request`: one trace per call, every sampled token trainable (when its data allows).

Lossless and exact, but a coding session yields hundreds of short, heavily overlapping samples: the
trainer processes every prompt again, and an outcome reward broadcast to each of them invited reward
hacking in the Polar paper. Kept as the baseline and for trainers that want per-call samples.
"""

from __future__ import annotations

from collections.abc import Sequence

from polar.store.records import CompletionRecord
from polar.trajectory.calls import prepare
from polar.trajectory.chains import Chain, Turn
from polar.trajectory.models import Trajectory, TrajectoryStatus
from polar.trajectory.retries import DeadBranches
from polar.trajectory.sequences import chain_trace
from polar.trajectory.stats import compute


def per_request(
    records: Sequence[CompletionRecord],
    *,
    status: TrajectoryStatus = TrajectoryStatus.COMPLETED,
    train_without_logprobs: bool = False,
    dead_branches: DeadBranches = "train",
) -> Trajectory:
    prepared = prepare(records, train_without_logprobs, dead_branches)
    chains = [
        Chain(index=i, turns=[Turn(call)], started_by="per_request") for i, call in enumerate(prepared.calls)
    ]
    traces = [chain_trace(c) for c in chains]
    stats = compute(
        "per_request",
        len(records),
        prepared,
        chains,
        traces,
        options={"train_without_logprobs": train_without_logprobs, "dead_branches": dead_branches},
    )
    session = records[0].session_id if records else None
    return Trajectory(status=status, traces=traces, metadata={"session_id": session, **stats.to_dict()})
