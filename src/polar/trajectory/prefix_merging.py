"""`prefix_merging`: each chain of calls that extend one another becomes one trace (see `chains`).

Options:
- `on_drift`: "split" (default) ends a chain where the server's re-rendering of a sampled turn differs
  from the sampled tokens, so every trace is exactly the context the policy saw; "merge" merges anyway (the
  reference's behaviour, leaning on importance-sampling correction) and lists those turns in the trace's
  `drift_turns`.
- `eot_id`: the end-of-turn token used to cut interstitials at drifted boundaries; inferred from the
  records when not given (`calls.infer_eot`). Exact boundaries never need it.
- `train_without_logprobs`: see `calls`.
- `dead_branches`: "train" (default), "mask" or "drop" the answers a harness retried and never used
  (`retries`); with "drop" a retried conversation is one trace.

Every captured trainable token lands, trainable, in exactly one trace: `coverage` is 1.0 by construction
and `audit` proves it against the records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from polar.store.records import CompletionRecord
from polar.trajectory.calls import infer_eot, prepare
from polar.trajectory.chains import assemble
from polar.trajectory.errors import BuildError
from polar.trajectory.models import Trajectory, TrajectoryStatus
from polar.trajectory.retries import DeadBranches
from polar.trajectory.sequences import chain_trace
from polar.trajectory.stats import compute

OnDrift = Literal["split", "merge"]


def prefix_merging(
    records: Sequence[CompletionRecord],
    *,
    status: TrajectoryStatus = TrajectoryStatus.COMPLETED,
    on_drift: OnDrift = "split",
    eot_id: int | None = None,
    train_without_logprobs: bool = False,
    dead_branches: DeadBranches = "train",
) -> Trajectory:
    if on_drift not in ("split", "merge"):
        raise BuildError(f"on_drift must be 'split' or 'merge', not {on_drift!r}", param="on_drift")
    if eot_id is not None and (isinstance(eot_id, bool) or not isinstance(eot_id, int) or eot_id < 0):
        raise BuildError(f"eot_id must be a token id, not {eot_id!r}", param="eot_id")
    prepared = prepare(records, train_without_logprobs, dead_branches)
    eot = eot_id if eot_id is not None else infer_eot(c.record for c in prepared.calls)
    assembly = assemble(prepared.calls, eot, merge_drift=on_drift == "merge")
    traces = [chain_trace(c) for c in assembly.chains]
    stats = compute(
        "prefix_merging",
        len(records),
        prepared,
        assembly.chains,
        traces,
        drift_turns=assembly.drift_turns,
        drift_merged=assembly.drift_merged,
        eot_id=eot,
        options={
            "on_drift": on_drift,
            "eot_id": eot_id,
            "train_without_logprobs": train_without_logprobs,
            "dead_branches": dead_branches,
        },
    )
    session = records[0].session_id if records else None
    return Trajectory(status=status, traces=traces, metadata={"session_id": session, **stats.to_dict()})
