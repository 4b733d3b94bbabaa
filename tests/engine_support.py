"""Shared helpers for the engine tests: the tiny default model behind a real loopback server."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from polar.engine import Engine, EngineConfig, create_engine_app
from tests.fakes.server import ServerThread, serve

# Small enough that the context-overflow test never runs a forward pass.
TEST_CONTEXT = 2048


def load_tiny(**config: object) -> Engine:
    cfg = EngineConfig(**{"max_num_seqs": 16, "prefill_chunk": 256, **config})  # type: ignore[arg-type]
    return Engine.load(None, max_model_len=TEST_CONTEXT, config=cfg)


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
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
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
