"""A tiny causal LM for the training-math tests: Qwen3's architecture at toy size, seeded."""

from __future__ import annotations

import torch


def tiny_lm(attn: str = "eager") -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        attn_implementation=attn,
    )
    return Qwen3ForCausalLM(cfg)
