"""What a trainer receives: `Trace` and `Trajectory`, pydantic at the edge (HTTP, export, custom builders).

A trace is one token sequence: `prompt_ids` the policy was given, then `response_ids` where `loss_mask`
says which tokens the policy sampled (1) and which came from a server prompt (0: tool results, template
glue, untrainable calls). `response_logprobs` are the behaviour policy's logprobs, 0.0 where masked, and
`None` only when some trainable token has no logprob (a build that opted into `train_without_logprobs`).

Builders construct these from already-checked token data, so they skip validation on the hot path
(`Trace.trusted`); anything arriving from outside goes through `model_validate`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

Bit = Annotated[int, Field(ge=0, le=1)]


class TrajectoryStatus(StrEnum):
    COMPLETED = "COMPLETED"
    TIMEOUT = "TIMEOUT"
    ERROR = "ERROR"


class Trace(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[Bit]
    response_logprobs: list[float] | None
    prompt_messages: list[dict[str, Any]] = Field(default_factory=list)
    response_messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    reward: float | None = None
    # session_id, completion_ids, seqs, turn_offsets, chain_index, policy_version, ... (see prefix_merging)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> Trace:
        n = len(self.response_ids)
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} response tokens")
        if self.response_logprobs is not None and len(self.response_logprobs) != n:
            raise ValueError(
                f"response_logprobs has {len(self.response_logprobs)} entries for {n} response tokens"
            )
        return self

    @classmethod
    def trusted(cls, **fields: Any) -> Trace:
        """Build without validation: for builders whose inputs were already checked token by token."""
        return cls.model_construct(**fields)

    @property
    def trainable_tokens(self) -> int:
        return sum(self.loss_mask)


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: TrajectoryStatus = TrajectoryStatus.COMPLETED
    traces: list[Trace] = Field(default_factory=list)
    # session_id, strategy, options and the reconstruction stats (calls, chains, breaks, coverage, ...)
    metadata: dict[str, Any] = Field(default_factory=dict)
