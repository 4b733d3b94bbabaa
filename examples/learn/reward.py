"""A dense reward the offline tiny policy can learn: the share of its sampled tokens that fall in a set.

The tiny policy (`polar.engine.Engine.load(None)`) has random weights and a 151k-token vocabulary, so a set
picked by meaning (digits, common words) or by id range is scattered at random in its embedding space: no
single change of its hidden state makes all of those tokens likelier, and 30 steps of a few hundred sampled
tokens each cannot move 75k rows one by one. The default set is therefore one the model *can* reach: the
tokens whose initial embedding has a positive coordinate `coordinate` (a half-space, about half the
vocabulary). Every move of the hidden state along that axis raises them all together, so GRPO has a
gradient it can follow. This is a check that the loop moves the policy towards its reward, not a language
task.

Used from a task file in this folder as `evaluator: {strategy: "reward:TokenSetReward"}` (a task file's
import paths resolve relative to the file); config `ids` (a list) or `below` (an id bound) names the set instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import Field

from polar.evaluate.base import EvalContext, EvalResult
from polar.evaluate.support import StrictConfig, parse_config


class _Config(StrictConfig):
    ids: list[int] | None = None  # the target set; default: the half-space of the model's embeddings
    below: int | None = Field(None, ge=1)  # or: every id below this (the control run in docs/training.md)
    model: str | None = None  # a folder with model.safetensors; None: the offline tiny model
    coordinate: int = Field(0, ge=0)


@cache
def half_space(model: str | None, coordinate: int) -> frozenset[int]:
    """Token ids whose embedding row (as stored in `model`, i.e. before any training) has
    `row[coordinate] > 0`. Read once per process, from the file, never from the live policy."""
    from safetensors import safe_open

    from polar.engine.tiny import default_model_dir

    folder = Path(model) if model else default_model_dir()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    if not coordinate < table.shape[1]:
        raise ValueError(f"coordinate {coordinate} is outside the {table.shape[1]} embedding dimensions")
    return frozenset((table[:, coordinate] > 0).nonzero().flatten().tolist())


def token_share(trajectory: Any, targets: frozenset[int]) -> tuple[float, int]:
    """Share of the trainable (sampled) response tokens in `targets`, and how many tokens were counted."""
    hits = total = 0
    for trace in trajectory.traces:
        for tok, bit in zip(trace.response_ids, trace.loss_mask, strict=True):
            if bit:
                total += 1
                hits += tok in targets
    return (hits / total if total else 0.0), total


class TokenSetReward:
    name = "token_set"
    needs_fresh_runtime = False

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = parse_config(self.name, _Config, config)
        if self.config.ids is not None and self.config.below is not None:
            raise ValueError(f"evaluator {self.name!r}: evaluator.config: give ids or below, not both")
        self._targets: frozenset[int] | None = None
        if self.config.ids is not None:
            self._targets = frozenset(self.config.ids)
        elif self.config.below is not None:
            self._targets = frozenset(range(self.config.below))

    @property
    def targets(self) -> frozenset[int]:
        if self._targets is None:
            self._targets = half_space(self.config.model, self.config.coordinate)
        return self._targets

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        share, counted = token_share(ctx.trajectory, self.targets)
        # No sampled token at all is the policy's failure (reward 0), not the evaluator's.
        return EvalResult(reward=share, details={"tokens": counted})
