"""Reconstruction stats, written into `Trajectory.metadata` (the contract's `coverage` lives here)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from polar.trajectory.calls import Prepared
from polar.trajectory.chains import BREAKS, RETRY, ROOT, Chain
from polar.trajectory.models import Trace


@dataclass(frozen=True, slots=True)
class BuildStats:
    strategy: str
    calls: int  # records given
    traces: int
    chains: int
    merged_calls: int  # calls that continued a chain instead of starting a trace
    roots: int  # chains that continue nothing (first call, subagents, side calls)
    siblings: int  # chains started by a retry of an identical prompt
    breaks: dict[str, int]  # chains started because a conversation broke, by cause
    drift_turns: int  # boundaries whose re-rendered turn differs from the sampled tokens
    drift_merged: int  # of those, merged anyway (on_drift="merge")
    skipped: dict[str, int]  # calls placed in no trace (no usable prompt ids), by cause
    prompt_tokens: int  # prompt tokens captured over all calls
    sampled_tokens: int  # trainable sampled tokens captured: the coverage denominator
    untrainable_tokens: int  # sampled tokens captured without the data to train them
    trainable_tokens: int  # tokens with loss_mask 1 over all traces
    coverage: float  # trainable_tokens / sampled_tokens; 1.0 when nothing trainable was captured
    trainer_tokens: int  # prompt + response tokens over all traces: what a trainer processes
    eot_id: int | None
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute(
    strategy: str,
    calls: int,
    prepared: Prepared,
    chains: Sequence[Chain],
    traces: Sequence[Trace],
    *,
    drift_turns: int = 0,
    drift_merged: int = 0,
    eot_id: int | None = None,
    options: dict[str, Any] | None = None,
) -> BuildStats:
    causes = Counter(c.started_by for c in chains)
    trainable = sum(t.metadata["trainable_tokens"] for t in traces)
    return BuildStats(
        strategy=strategy,
        calls=calls,
        traces=len(traces),
        chains=len(chains),
        merged_calls=sum(len(c.turns) - 1 for c in chains),
        roots=causes[ROOT],
        siblings=causes[RETRY],
        breaks={cause: causes[cause] for cause in BREAKS if causes[cause]},
        drift_turns=drift_turns,
        drift_merged=drift_merged,
        skipped=prepared.skipped,
        prompt_tokens=prepared.prompt_tokens,
        sampled_tokens=prepared.sampled_tokens,
        untrainable_tokens=prepared.untrainable_tokens,
        trainable_tokens=trainable,
        coverage=trainable / prepared.sampled_tokens if prepared.sampled_tokens else 1.0,
        trainer_tokens=sum(len(t.prompt_ids) + len(t.response_ids) for t in traces),
        eot_id=eot_id,
        options=options or {},
    )
