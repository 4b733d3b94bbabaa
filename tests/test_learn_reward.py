"""The demonstration's evaluator (examples/learn/reward.py): share of sampled tokens in a target set."""

from __future__ import annotations

from pathlib import Path

import pytest
from examples.learn.reward import TokenSetReward, half_space

from polar import plugins
from polar.evaluate.base import EvalContext
from polar.evaluate.registry import get_evaluator
from polar.trajectory.models import Trace, Trajectory

PATH = "examples.learn.reward:TokenSetReward"
# A task file at the repository root naming PATH would resolve it from there: trust it as that run would.
plugins.trust_file_import(PATH, Path(__file__).resolve().parents[1])


def trace(response: list[int], mask: list[int]) -> Trace:
    return Trace(prompt_ids=[1, 2], response_ids=response, loss_mask=mask, response_logprobs=None)  # type: ignore[arg-type]


def ctx(*traces: Trace) -> EvalContext:
    return EvalContext(
        task=None,
        session_id="s",
        runtime=None,  # type: ignore[arg-type]
        fresh=None,
        agent=None,
        trajectory=Trajectory(traces=list(traces)),
    )


async def test_share_counts_only_sampled_tokens_across_traces() -> None:
    ev = get_evaluator(PATH, {"ids": [5, 7]})
    # Trace 1: sampled 5, 9, 7 (2 hits); the masked 5 is a tool output and does not count.
    # Trace 2: sampled 8 (miss), masked 7 ignored. 2 hits of 4 sampled tokens.
    result = await ev.evaluate(ctx(trace([5, 9, 5, 7], [1, 1, 0, 1]), trace([7, 8], [0, 1])))
    assert result.reward == pytest.approx(0.5)
    assert result.details == {"tokens": 4}


async def test_no_sampled_tokens_is_reward_zero() -> None:
    ev = TokenSetReward({"ids": [1]})
    result = await ev.evaluate(ctx(trace([1, 1], [0, 0])))
    assert result.reward == 0.0
    assert result.details == {"tokens": 0}


def test_default_set_is_the_half_space_of_the_tiny_embeddings() -> None:
    from safetensors import safe_open

    from polar.engine.tiny import default_model_dir

    with safe_open(str(default_model_dir() / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    targets = half_space(None, 3)
    assert targets == {i for i in range(table.shape[0]) if table[i, 3] > 0}
    assert 0.4 < len(targets) / table.shape[0] < 0.6  # about half: groups start with variance
    with pytest.raises(ValueError, match="coordinate 64"):
        half_space(None, table.shape[1])


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"evaluator\.config\.ids"):
        get_evaluator(PATH, {"ids": "abc"})
    with pytest.raises(ValueError, match=r"evaluator\.config\.extra"):
        get_evaluator(PATH, {"extra": 1})


async def test_below_is_an_id_bound() -> None:
    ev = get_evaluator(PATH, {"below": 10})
    result = await ev.evaluate(ctx(trace([3, 9, 10, 500], [1, 1, 1, 1])))
    assert result.reward == pytest.approx(0.5)
    with pytest.raises(ValueError, match="ids or below"):
        get_evaluator(PATH, {"ids": [1], "below": 3})
    with pytest.raises(ValueError, match=r"evaluator\.config\.below"):
        get_evaluator(PATH, {"below": 0})
