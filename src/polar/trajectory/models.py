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
    """One token sequence: the prompt the policy was given, then response tokens where `loss_mask` marks
    what the policy sampled (1) and what came from later prompts (0: tool results, template glue)."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int] = Field(
        description="The first call's prompt, as the inference server tokenized it."
    )
    response_ids: list[int] = Field(
        description="Everything after the prompt: sampled turns and, between them, tool results and "
        "template glue from later prompts."
    )
    loss_mask: list[Bit] = Field(
        description="One per response token: 1 = sampled by the policy and trainable, 0 = not."
    )
    response_logprobs: list[float] | None = Field(
        description="One per response token: the behaviour policy's logprob where the mask is 1, 0.0 "
        "elsewhere; null only for builds with train_without_logprobs."
    )
    prompt_messages: list[dict[str, Any]] = Field(
        default_factory=list, description="The first call's messages (OpenAI Chat form)."
    )
    response_messages: list[dict[str, Any]] = Field(
        default_factory=list,
        description="The messages after them: assistant turns (with tool calls), tool results, user turns.",
    )
    tools: list[dict[str, Any]] | None = Field(
        None, description="The tools the policy was given (OpenAI Chat form)."
    )
    finish_reason: str | None = Field(None, description="How the last call ended: stop, tool_calls, length.")
    reward: float | None = Field(None, description="The trace's reward (set by the node's reward rules).")
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Reconstruction details: completion ids, turn offsets, versions."
    )

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
    """One session's traces: the unit a reward and an advantage belong to."""

    model_config = ConfigDict(extra="forbid")

    status: TrajectoryStatus = Field(
        TrajectoryStatus.COMPLETED,
        description="COMPLETED, TIMEOUT or ERROR (after the reward rules: an unusable evaluation is ERROR).",
    )
    traces: list[Trace] = Field(default_factory=list, description="The session's traces, in build order.")
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="session_id, the build's strategy, options and stats (coverage, ...), rewards.",
    )
