"""Shared helpers for the engine tests: the tiny default model behind a real loopback server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoTokenizer

from polar.engine import Engine, EngineConfig, create_engine_app
from tests.fakes.server import ServerThread, serve

# Small enough that the context-overflow test never runs a forward pass.
TEST_CONTEXT = 2048


def load_tiny(**config: object) -> Engine:
    cfg = EngineConfig(**{"max_num_seqs": 16, "prefill_chunk": 256, **config})  # type: ignore[arg-type]
    # float32 everywhere: the tests compare logprobs exactly; POLAR_TEST_DEVICE=cuda runs them on a GPU.
    device = os.environ.get("POLAR_TEST_DEVICE", "auto")
    return Engine.load(None, device=device, dtype="float32", max_model_len=TEST_CONTEXT, config=cfg)


@contextmanager
def tiny_server(**config: object) -> Iterator[tuple[Engine, ServerThread]]:
    engine = load_tiny(**config)
    try:
        with serve(create_engine_app(engine)) as srv:
            yield engine, srv
    finally:
        engine.stop()


def reference_logprobs(
    model: torch.nn.Module,
    prompt_ids: list[int],
    output_ids: list[int],
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[float]:
    """Logprob of each sampled token under the processed distribution, from one full forward pass.

    Written independently of the engine's sampler (sort-based masks) so the test can catch its mistakes.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + output_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float().cpu()
    out = []
    for row, tok in zip(logits, output_ids, strict=True):
        if temperature == 0:
            out.append(float(torch.log_softmax(row, -1)[tok]))
            continue
        x = row / temperature
        if top_k > 0:
            kth = torch.sort(x, descending=True).values[top_k - 1]
            x = torch.where(x < kth, torch.tensor(float("-inf")), x)
        if top_p < 1.0:
            probs = torch.softmax(x, -1)
            sorted_p, order = torch.sort(probs, descending=True)
            mass_before = torch.cumsum(sorted_p, 0) - sorted_p
            drop = order[mass_before >= top_p]
            x[drop] = float("-inf")
        out.append(float(torch.log_softmax(x, -1)[tok]))
    return out


class ScriptedLM(torch.nn.Module):
    """A stand-in network that greedily "generates" a fixed token script, so tests can make the real engine
    emit exact tool calls and thoughts. Position p + 1 - `start` of the script is predicted at position p;
    past the script it predicts `eos`. It fills the cache like a one-layer model so batching code runs."""

    def __init__(self, vocab_size: int, eos: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.eos = eos
        self.script: list[int] = []
        self.start = 0
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Any = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> Any:
        bsz, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length).unsqueeze(0).expand(bsz, length)
        if cache is not None:
            kv = torch.zeros(bsz, 1, length, 1)
            cache.update(kv, kv.clone(), 0)
        last = position_ids[:, -1].tolist()
        logits = torch.zeros(bsz, 1, self.vocab_size)
        for row, pos in enumerate(last):
            i = pos + 1 - self.start
            target = self.script[i] if 0 <= i < len(self.script) else self.eos
            logits[row, 0, target] = 50.0
        return SimpleNamespace(logits=logits)


def scripted_engine(**config: object) -> tuple[Engine, ScriptedLM]:
    from polar.engine.loader import LoadedModel
    from polar.engine.tiny import qwen_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    model = ScriptedLM(len(tok), tok.convert_tokens_to_ids("<|im_end|>"))
    loaded = LoadedModel(
        model=model,
        tokenizer=tok,
        name="scripted",
        source="tests",
        max_model_len=TEST_CONTEXT,
        eos_token_ids=frozenset({model.eos}),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    return Engine(loaded, EngineConfig(**config)).start(), model  # type: ignore[arg-type]
