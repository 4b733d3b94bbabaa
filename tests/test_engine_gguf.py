"""Loading a GGUF file: the tiny model written as GGUF loads with the same tokenizer, template and logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polar.engine.loader import load_model
from polar.engine.tiny import default_model_dir

_LAYER_NAMES = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
]


def _write_gguf(src: Path, out: Path) -> None:
    """The HF folder as a float32 GGUF under llama.cpp's qwen3 names (what its converter would write)."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    template = json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    w = gguf.GGUFWriter(str(out), "qwen3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    tokens = [""] * cfg["vocab_size"]
    types = [1] * cfg["vocab_size"]
    for text, i in tok["model"]["vocab"].items():
        tokens[i] = text
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(151645)
    w.add_bos_token_id(151643)
    w.add_pad_token_id(151643)
    w.add_chat_template(template)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in _LAYER_NAMES:
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for key, tensor in load_file(str(src / "model.safetensors")).items():
        w.add_tensor(names[key], tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.slow
def test_gguf_file_loads_like_the_hf_folder(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")  # transformers needs it for GGUF
    src = default_model_dir()
    _write_gguf(src, tmp_path / "tiny.gguf")
    hf = load_model(str(src))
    gg = load_model(str(tmp_path / "tiny.gguf"), max_model_len=4096)
    assert gg.name == "tiny" and gg.max_model_len == 4096
    messages = [{"role": "user", "content": "héllo wörld, 你好 <tool_call> ok"}]
    a = hf.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    b = gg.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert a == b
    ids = hf.tokenizer.encode(a, add_special_tokens=False)
    assert gg.tokenizer.encode(b, add_special_tokens=False) == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.allclose(hf.model(input_ids=x).logits, gg.model(input_ids=x).logits, atol=1e-5)
