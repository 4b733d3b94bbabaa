"""LoRA for the reference trainer: low-rank adapters (peft) on the policy's linear layers.

Only the adapters train, so AdamW keeps state for a few million numbers instead of every weight, and a
backward pass computes no weight gradient for the frozen ones. The servers are given what they load:
`merged_state_dict` folds each adapter into its layer (W + scale * B @ A) without touching the live
weights (merging in place and unmerging later would leave W off by rounding after every sync), under the
base model's own names, so vLLM's `reload_weights` and the embedded engine take it like a full model.

    model = apply_lora(model, LoraSpec(r=16, alpha=32))
    merged = merged_state_dict(model)          # {"model.layers.0.self_attn.q_proj.weight": ..., ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and peft load when LoRA is used, not when a config naming it is validated
    import torch
    from peft import PeftModel
    from torch import nn

ADAPTER_DIR = "adapter"  # inside a checkpoint folder: the adapter weights a resumed run continues from


@dataclass(frozen=True, slots=True)
class LoraSpec:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"


def _peft() -> ModuleType:
    try:
        import peft
    except ImportError:
        raise RuntimeError("LoRA needs peft: pip install 'polar-rl[lora]'") from None
    return peft


def apply_lora(model: nn.Module, spec: LoraSpec) -> PeftModel:
    """`model` wrapped with fresh adapters (B = 0: the wrapped model computes exactly what `model` does)."""
    peft = _peft()
    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    config = peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped: PeftModel = peft.get_peft_model(model, config)
    return wrapped


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in, detached; keys as the base model names
    them (`...q_proj.weight`, no `base_layer`, no `lora_`)."""
    import torch

    peft = _peft()
    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    wrapped: dict[str, Any] = {}
    for name, module in base.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            wrapped[name] = module
    with torch.no_grad():
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            owner, _, leaf = key.rpartition(".base_layer.")
            if owner in wrapped:
                layer = wrapped[owner]
                tensor = value.detach()
                if leaf == "weight":
                    for adapter in layer.active_adapters:
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
                out[f"{owner}.{leaf}"] = tensor
            else:
                out[key] = value.detach()
    return out


def save_adapter(model: Any, folder: Path) -> None:
    # `model` is a PeftModel; Any because peft annotates `save_directory` as str and this passes a Path.
    model.save_pretrained(folder / ADAPTER_DIR)


def load_adapter(model: PeftModel, folder: Path) -> None:
    """The adapter weights a checkpoint saved, into `model`'s adapters (same spec)."""
    peft = _peft()
    from safetensors.torch import load_file

    path = folder / ADAPTER_DIR / "adapter_model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: a LoRA run resumes from a checkpoint with its adapter")
    result = peft.set_peft_model_state_dict(model, load_file(str(path)))
    missing = [k for k in getattr(result, "missing_keys", []) if ".lora_" in k]
    if missing:
        raise ValueError(f"{path}: the adapter lacks {missing[0]} (was it trained with another lora spec?)")
