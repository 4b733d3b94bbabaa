"""The reference trainer on the offline tiny model: samples, micro-batches, one step, checkpoints."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from polar.train.loss import LossConfig
from polar.train.packing import pack, response_logprobs
from polar.train.schedule import LRSchedule
from polar.train.trainer import (
    OptimizerConfig,
    Sample,
    Trainer,
    TrainerConfig,
    build_samples,
    micro_batches,
)
from polar.trajectory.models import Trace, Trajectory

PROMPTS = [[151644, 872, 198, 9707], [151644, 872, 198, 3838, 374], [151644, 77091, 198]]
RESPONSES = [[40, 1079, 264, 2272], [9707, 0, 1654], [2132, 374, 6437, 13, 151645]]


@pytest.fixture(scope="module")
def base() -> Iterator[Trainer]:
    yield Trainer.load(TrainerConfig(device="cpu"))


def fresh(base: Trainer, **config: object) -> Trainer:
    """A trainer on a copy of the loaded model (loading once per module keeps the tests fast)."""
    cfg = TrainerConfig(device="cpu", **config)  # type: ignore[arg-type]
    return Trainer(copy.deepcopy(base.model), base.tokenizer, cfg)


def own_logprobs(trainer: Trainer, prompt: list[int], response: list[int]) -> list[float]:
    """The model's own logprobs of `response`: behaviour = current policy, as right after a sync."""
    with torch.no_grad():
        return response_logprobs(trainer.model, pack([(prompt, response)], 64)).tolist()


def samples_for(
    trainer: Trainer, advantages: list[float], masks: list[list[int]] | None = None
) -> list[Sample]:
    out = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        mask = masks[i] if masks else [1] * len(r)
        out.append(Sample(p, r, mask, own_logprobs(trainer, p, r), advantages[i], 1.0))
    return out


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def test_micro_batches_cap_tokens_and_honour_grad_accum() -> None:
    assert micro_batches([4, 4, 4, 4], max_tokens=8) == [[0, 1], [2, 3]]
    assert micro_batches([4, 4, 4, 4], max_tokens=100, at_least=4) == [[0], [1], [2], [3]]
    assert micro_batches([4, 4, 4, 4], max_tokens=100) == [[0, 1, 2, 3]]
    assert micro_batches([3, 20, 3], max_tokens=8) == [[0], [1], [2]]  # a long trace goes alone
    assert micro_batches([], max_tokens=8) == []


def _traj(
    rewards: float, group: str, *, logprobs: bool = True, masked: bool = False, traces: int = 1
) -> Trajectory:
    trs = [
        Trace(
            prompt_ids=[1, 2],
            response_ids=[3, 4, 5],
            loss_mask=[1, 0, 1],
            response_logprobs=[-1.0, 0.0, -2.0] if logprobs else None,
        )
        for _ in range(traces)
    ]
    meta = {"reward": rewards, "group_id": group, **({"masked": True} if masked else {})}
    return Trajectory(traces=trs, metadata=meta)


def test_build_samples_weights_advantages_and_skips() -> None:
    trajectories = [
        _traj(1.0, "g", traces=2),  # split session: two traces, half the weight each
        _traj(0.0, "g"),
        _traj(0.0, "g", logprobs=False),  # no behaviour logprobs: never trained on, counted
        _traj(1.0, "g", masked=True),  # masked: not part of the group at all
    ]
    samples, stats, skipped = build_samples(trajectories, "dr_grpo")
    assert skipped == 1 and stats.masked == 1 and stats.samples == 3
    mean = 1.0 / 3.0
    assert [s.weight for s in samples] == [0.5, 0.5, 1.0]
    assert [s.advantage for s in samples] == pytest.approx([1 - mean, 1 - mean, -mean])
    assert list(samples[0].mask) == [1, 0, 1] and list(samples[0].behaviour_logprobs) == [-1.0, 0.0, -2.0]


def test_step_raises_positive_and_lowers_negative_logprobs(base: Trainer) -> None:
    trainer = fresh(base, optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0))
    samples = samples_for(trainer, [1.0, -1.0, 0.0])
    before = [sum(s.behaviour_logprobs) for s in samples]
    result = trainer.step(samples)
    after = [sum(own_logprobs(trainer, list(s.prompt_ids), list(s.response_ids))) for s in samples]
    assert after[0] > before[0] and after[1] < before[1]
    assert trainer.step_count == 1 and result.traces == 3 and result.grad_norm > 0
    assert result.metrics.tokens == sum(len(r) for r in RESPONSES)
    # Behaviour logprobs were the model's own: the trainer reproduces them (ratio 1, TIS weight 1).
    assert result.logprob_diff < 1e-4 and result.metrics.tis_mean == pytest.approx(1.0, abs=1e-4)


def test_masked_tokens_do_not_move_the_policy(base: Trainer) -> None:
    trainer = fresh(base, optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0))
    zero = [[0] * len(r) for r in RESPONSES]
    before = params(trainer)
    result = trainer.step(samples_for(trainer, [1.0, -1.0, 1.0], masks=zero))
    assert result.metrics.tokens == 0 and result.grad_norm == 0.0
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_gradient_accumulation_matches_one_batch(base: Trainer, aggregation: str) -> None:
    loss = LossConfig(aggregation=aggregation)  # type: ignore[arg-type]
    # eps 1: Adam's first update ~ lr * g (not lr * sign(g), which turns float noise in tiny gradients
    # into full-size steps), so equal gradients show as equal parameters.
    opt = OptimizerConfig(lr=1e-3, weight_decay=0.0, eps=1.0, grad_clip=None)
    whole = fresh(base, loss=loss, optimizer=opt, micro_batch_tokens=4096)
    split = fresh(base, loss=loss, optimizer=opt, micro_batch_tokens=4096, grad_accum=3)
    one = whole.step(samples_for(whole, [1.0, -0.5, 0.25]))
    three = split.step(samples_for(split, [1.0, -0.5, 0.25]))
    assert one.micro_batches == 1 and three.micro_batches == 3
    assert three.loss == pytest.approx(one.loss, rel=1e-4, abs=1e-7)
    assert three.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
    a, b = params(whole), params(split)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_gradient_checkpointing_gives_the_same_step(base: Trainer) -> None:
    opt = OptimizerConfig(lr=1e-3, weight_decay=0.0, eps=1.0)  # eps: see the accumulation test
    plain = fresh(base, optimizer=opt)
    ckpt = fresh(base, optimizer=opt, gradient_checkpointing=True)
    r1 = plain.step(samples_for(plain, [1.0, -1.0, 0.5]))
    # transformers 5.x: is_activation_checkpointing (is_gradient_checkpointing is deprecated)
    assert ckpt.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    r2 = ckpt.step(samples_for(ckpt, [1.0, -1.0, 0.5]))
    assert r2.grad_norm == pytest.approx(r1.grad_norm, rel=1e-4)
    a, b = params(plain), params(ckpt)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_kl_to_the_initial_policy_appears_after_a_step(base: Trainer) -> None:
    trainer = fresh(base, loss=LossConfig(kl_coef=0.1), optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0))
    assert trainer.reference is not None
    first = trainer.step(samples_for(trainer, [1.0, -1.0, 0.5]))
    second = trainer.step(samples_for(trainer, [1.0, -1.0, 0.5]))
    assert first.metrics.kl == pytest.approx(0.0, abs=1e-6) and second.metrics.kl > 0.0
    assert fresh(base).reference is None  # no KL, no reference copy


def test_bf16_autocast_is_taken_on_a_cpu_when_asked_and_never_chosen_for_it(base: Trainer) -> None:
    assert fresh(base, dtype="bfloat16").autocast is torch.bfloat16  # AMX / AVX512-BF16 make it fast
    assert fresh(base, dtype="auto").autocast is None  # CPU: float32, no autocast
    trainer = fresh(base, dtype="bfloat16", optimizer=OptimizerConfig(lr=1e-2))
    result = trainer.step(samples_for(trainer, [1.0, -1.0, 0.5]))
    assert math.isfinite(result.loss) and all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_checkpoint_is_a_loadable_model_with_optimizer_state(base: Trainer, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polar.engine.weights import load_checkpoint

    trainer = fresh(base, optimizer=OptimizerConfig(lr=1e-2))
    trainer.step(samples_for(trainer, [1.0, -1.0, 0.5]))
    folder = trainer.save(tmp_path / "checkpoints" / "step-1")
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert AutoTokenizer.from_pretrained(folder).encode("hello") == trainer.tokenizer.encode("hello")
    assert json.loads((folder / "trainer_state.json").read_text())["step"] == 1
    assert load_checkpoint(folder)  # what a policy server's update_weights reads

    resumed = fresh(base)
    resumed.restore(folder)
    assert resumed.step_count == 1
    state = resumed.optimizer.state_dict()["state"]
    assert state and all(int(s["step"]) == 1 for s in state.values())


def test_a_batch_with_nothing_trainable_steps_without_changing_weights(base: Trainer) -> None:
    trainer = fresh(base, optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1))
    before = params(trainer)
    result = trainer.step([])  # every session masked or untrainable: a version, but the same weights
    assert trainer.step_count == 1 and result.traces == 0 and result.micro_batches == 0
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())


def test_the_schedule_warms_up_then_decays_to_its_floor() -> None:
    cos = LRSchedule("cosine", warmup_steps=2, min_lr_ratio=0.1, total_steps=6)
    assert [round(cos.factor(s), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.775, 0.325, 0.1, 0.1]
    lin = LRSchedule("linear", warmup_steps=0, min_lr_ratio=0.0, total_steps=5)
    assert [lin.factor(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert [LRSchedule("constant", warmup_steps=4).factor(s) for s in (0, 3, 9)] == [0.25, 1.0, 1.0]
    assert LRSchedule("cosine", total_steps=None).factor(7) == 1.0  # no horizon: no decay
    assert LRSchedule("linear", total_steps=1).factor(0) == 0.0  # a one-step run ends at its floor


def test_each_step_takes_the_scheduled_rate(base: Trainer) -> None:
    schedule = LRSchedule("cosine", warmup_steps=2, min_lr_ratio=0.1, total_steps=4)
    trainer = fresh(base, optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0, schedule=schedule))
    rates = []
    for _ in range(4):
        result = trainer.step(samples_for(trainer, [1.0, -1.0, 0.0]))
        assert all(g["lr"] == result.lr for g in trainer.optimizer.param_groups)
        rates.append(result.lr)
    assert rates == pytest.approx([5e-4, 1e-3, 1e-3, 1e-4])
