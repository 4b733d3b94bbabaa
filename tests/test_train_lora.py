"""LoRA in the reference trainer (polar.train.lora) on the offline tiny model: only adapters move, what a
server is given is the base model with the adapters folded in, and a LoRA run resumes from its adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polar.train.lora import LoraSpec, merged_state_dict
from polar.train.packing import pack, response_logprobs
from polar.train.trainer import OptimizerConfig, Sample, Trainer, TrainerConfig

PROMPTS = [[151644, 872, 198, 9707], [151644, 872, 198, 3838, 374], [151644, 77091, 198]]
RESPONSES = [[40, 1079, 264, 2272], [9707, 0, 1654], [2132, 374, 6437, 13, 151645]]
SPEC = LoraSpec(r=4, alpha=8.0)


def lora_trainer(**config: object) -> Trainer:
    cfg = TrainerConfig(device="cpu", lora=SPEC, optimizer=OptimizerConfig(lr=1e-2), **config)  # type: ignore[arg-type]
    return Trainer.load(cfg)


def logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> list[float]:
    with torch.no_grad():
        return response_logprobs(model, pack([(prompt, response)], 64)).tolist()


def samples(trainer: Trainer, advantages: list[float]) -> list[Sample]:
    return [
        Sample(p, r, [1] * len(r), logprobs(trainer.model, p, r), a, 1.0)
        for p, r, a in zip(PROMPTS, RESPONSES, advantages, strict=True)
    ]


@pytest.fixture(scope="module")
def plain() -> Trainer:
    return Trainer.load(TrainerConfig(device="cpu"))


def test_fresh_adapters_change_nothing_and_a_step_moves_only_them(plain: Trainer) -> None:
    trainer = lora_trainer()
    base_lp = logprobs(plain.model, PROMPTS[0], RESPONSES[0])
    assert logprobs(trainer.model, PROMPTS[0], RESPONSES[0]) == pytest.approx(base_lp, abs=1e-6)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.step(samples(trainer, [1.0, -1.0, 0.5]))
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    assert any(not torch.equal(p, adapters[n]) for n, p in trainer.model.named_parameters() if n in adapters)
    # The optimizer holds state for the adapters alone: far fewer numbers than full fine-tuning.
    state = trainer.optimizer.state_dict()["state"]
    held = sum(s["exp_avg"].numel() for s in state.values())
    assert 0 < held == sum(p.numel() for n, p in trainer.model.named_parameters() if n in adapters)
    assert held < sum(p.numel() for p in plain.model.parameters()) / 20


def test_merged_weights_are_the_base_names_with_each_adapter_folded_in(plain: Trainer) -> None:
    trainer = lora_trainer()
    trainer.step(samples(trainer, [1.0, -1.0, 0.5]))
    merged = merged_state_dict(trainer.model)
    assert set(merged) == set(plain.model.state_dict())  # what vLLM's reload and the engine expect
    q = "model.layers.0.self_attn.q_proj"
    layer = trainer.model.get_base_model().get_submodule(q)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = layer.base_layer.weight + (SPEC.alpha / SPEC.r) * (b @ a)
    assert torch.allclose(merged[f"{q}.weight"], expected, atol=1e-6)
    assert not torch.equal(merged[f"{q}.weight"], plain.model.state_dict()[f"{q}.weight"])
    # A plain model given the merged weights computes what the adapted model computes.
    copy_ = Trainer.load(TrainerConfig(device="cpu")).model
    copy_.load_state_dict(merged)
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        assert logprobs(copy_, p, r) == pytest.approx(logprobs(trainer.model, p, r), abs=1e-4)
    # Folding in never touches the live weights (merging in place and back would drift by rounding).
    assert torch.equal(layer.base_layer.weight, plain.model.get_submodule(q).weight)


def test_a_lora_checkpoint_loads_as_a_plain_model_and_resumes_from_its_adapter(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer()
    trainer.step(samples(trainer, [1.0, -1.0, 0.5]))
    folder = trainer.save(tmp_path / "step-1")
    assert (folder / "adapter" / "adapter_model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(folder)  # the merged policy: any server loads it
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        assert logprobs(loaded, p, r) == pytest.approx(logprobs(trainer.model, p, r), abs=1e-4)

    resumed = lora_trainer()  # the base model again, fresh adapters ...
    resumed.restore(folder)  # ... then the checkpoint's adapter and optimizer state
    assert resumed.step_count == 1
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        assert logprobs(resumed.model, p, r) == pytest.approx(logprobs(trainer.model, p, r), abs=1e-6)
    other = Trainer.load(TrainerConfig(device="cpu", lora=LoraSpec(r=2, alpha=8.0)))
    with pytest.raises((ValueError, RuntimeError)):
        other.restore(folder)  # another rank: the adapter does not fit


async def test_the_engine_is_synced_with_the_adapters_folded_in() -> None:
    from polar.stack import embedded_engine
    from polar.train.sync import EngineSync

    trainer = lora_trainer()
    trainer.step(samples(trainer, [1.0, -1.0, 0.5]))
    merged = merged_state_dict(trainer.model)
    with embedded_engine(None, device="cpu") as (engine, _server):
        await EngineSync(engine).push(trainer, 1)
        served = engine.model.state_dict()
        assert engine.policy_version == 1
        for name, value in merged.items():
            assert torch.allclose(served[name], value), name
