"""Load a causal LM and its tokenizer from a Hugging Face id, a local folder or a GGUF file."""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from polar.engine.tiny import TINY_MODEL_NAME, default_model_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve. `name` is the id clients send as `model`."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    is_default_tiny: bool = False


def resolve_device(device: str | None) -> torch.device:
    """The device `device` names (auto: CUDA when available); ValueError for one that is not here."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r}: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available here (use cpu or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype in (None, "auto"):
        # CPU kernels for half types are slow or missing; GPUs want bf16 where supported.
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def load_model(
    spec: str | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    max_model_len: int | None = None,
    served_name: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load `spec`: None (the offline tiny default), a `.gguf` file, a local folder, or a hub id.
    `polar.modelsource.ModelNotFound` (an OSError) when it is none of these here and cannot be downloaded
    now; a cached hub id loads without the network when that cannot be used."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from polar.modelsource import locate_model

    hf_logging.disable_progress_bar()
    hub_logging.disable_propagation()  # it has a handler of its own: once, not again through the root's

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    is_tiny = spec is None
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    model_kwargs: dict[str, Any] = {}
    if spec is None:
        path = str(default_model_dir())
        name = served_name or TINY_MODEL_NAME
    elif spec.endswith(".gguf") and Path(spec).is_file():
        # transformers dequantizes GGUF weights into a normal torch model (needs the `gguf` package).
        gguf = Path(spec)
        path = str(gguf.parent)
        kwargs["gguf_file"] = gguf.name
        name = served_name or gguf.stem
        model_kwargs.update(_gguf_overrides(gguf))
    else:
        path = spec
        name = served_name or spec
    if spec is not None:  # fails at once, in one line, where the model cannot be had now (offline)
        _, local_only = locate_model(spec)
        if local_only:
            kwargs["local_files_only"] = True
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, **kwargs, **model_kwargs)
    model.to(dev)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    _check_supported(model)
    if dev.type == "cpu":
        _vocab_major_lm_head(model)

    limit = _context_length(model.config, tokenizer)
    if max_model_len is not None:
        if max_model_len > limit:
            log.warning("max_model_len %d exceeds the model's %d positions", max_model_len, limit)
        limit = max_model_len
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        source=spec or path,
        max_model_len=limit,
        eos_token_ids=frozenset(_eos_ids(model, tokenizer)),
        device=dev,
        dtype=dt,
        is_default_tiny=is_tiny,
    )


def _gguf_overrides(path: Path) -> dict[str, Any]:
    """Config values transformers' GGUF reader drops.

    transformers 5.x maps no `attention.key_length` for `qwen3`, so the head size falls back to Qwen3Config's
    128 and any other size fails to load with shape mismatches; read it from the file's metadata.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        return {}
    arch = str(arch_field.contents())
    field = reader.fields.get(f"{arch}.attention.key_length")
    return {"head_dim": int(field.contents())} if field is not None else {}


def _vocab_major_lm_head(model: PreTrainedModel) -> None:
    """On CPU, compute the output projection as `W @ h.T`.

    For [batch, hidden] x [vocab, hidden]^T with a large vocabulary, torch 2.x's CPU `F.linear` picks a kernel
    that is 2-3x slower than the same product taken vocab-major once the batch has a few rows; the LM head
    is most of a small model's decode step, so batching would barely pay. Same weights, same parameter
    names (the tie with the input embeddings stays), results equal up to float summation order.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return torch.matmul(self.weight, flat.T).T.reshape(*x.shape[:-1], self.weight.shape[0])

    head.forward = types.MethodType(forward, head)


def _check_supported(model: PreTrainedModel) -> None:
    """Reject architectures whose cache is not plain per-layer keys/values (the batcher edits those)."""
    cfg = (
        model.config.get_text_config(decoder=True)
        if hasattr(model.config, "get_text_config")
        else model.config
    )
    kinds = set(getattr(cfg, "layer_types", None) or [])
    unsupported = kinds - {"full_attention", "sliding_attention", "chunked_attention"}
    if unsupported:
        raise ValueError(
            f"the embedded engine batches key/value caches only; layer types {sorted(unsupported)} "
            "(linear attention / state-space) are not supported: serve this model with vLLM or SGLang"
        )


def _context_length(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> int:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**9:
        return value
    return 2048


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """EOS ids from the generation config (Qwen lists both `<|im_end|>` and `<|endoftext|>`) and tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
