"""Swapping the policy's weights between trainer steps, all or nothing.

A checkpoint is validated against the served model (every name known, every shape equal, every missing
tensor a tied alias such as `lm_head.weight`) before a single value is copied, so a bad checkpoint leaves
the served policy untouched and answers 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch


class WeightsError(ValueError):
    """The checkpoint cannot be applied to the served model (the message says why)."""


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a Hugging Face checkpoint folder (safetensors, else pytorch .bin shards)."""
    folder = Path(path)
    if not folder.is_dir():
        raise WeightsError(f"checkpoint path {str(folder)!r} is not a directory")
    state: dict[str, torch.Tensor] = {}
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        for shard in shards:
            state.update(load_file(str(shard)))
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise WeightsError(f"no *.safetensors or pytorch_model*.bin files in {str(folder)!r}")
    for shard in bins:
        state.update(torch.load(shard, map_location="cpu", weights_only=True))
    return state


def apply_state_dict(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> int:
    """Copy `state` into `model` in place after validating all of it; returns the number of tensors copied."""
    own = model.state_dict()
    unexpected = sorted(k for k in state if k not in own)
    if unexpected:
        raise WeightsError(f"checkpoint has tensors the model does not: {unexpected[:5]}")
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state.items()
        if tuple(v.shape) != tuple(own[k].shape)
    ]
    if mismatched:
        raise WeightsError(f"shape mismatch: {mismatched[:5]}")
    present = {own[k].data_ptr() for k in state}
    missing = sorted(k for k, t in own.items() if k not in state and t.data_ptr() not in present)
    if missing:
        raise WeightsError(f"checkpoint lacks tensors the model needs: {missing[:5]}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(device=own[k].device, dtype=own[k].dtype))
    return len(state)
