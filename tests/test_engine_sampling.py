"""The sampler: processed distributions, seeded draws, and the logprob it reports for what it drew."""

from __future__ import annotations

import pytest
import torch

from polar.engine.sampling import SamplingParams, make_generator, process_logits, sample


def _reference(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    x = logits.clone() / temperature
    if top_k > 0:
        kth = torch.sort(x, descending=True).values[top_k - 1]
        x[x < kth] = float("-inf")
    if min_p > 0:
        probs = torch.softmax(x, -1)
        x[probs < min_p * probs.max()] = float("-inf")
    if top_p < 1:
        probs = torch.softmax(x, -1)
        sorted_p, order = torch.sort(probs, descending=True)
        x[order[(torch.cumsum(sorted_p, 0) - sorted_p) >= top_p]] = float("-inf")
    return torch.log_softmax(x, -1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p", "vocab", "scale"),
    [
        (1.0, 0, 1.0, 0.0, 50, 3.0),
        (0.5, 10, 1.0, 0.0, 50, 3.0),
        (1.2, 0, 0.8, 0.0, 50, 3.0),
        (0.9, 20, 0.7, 0.05, 50, 3.0),
        (1.0, 0, 0.9, 0.0, 5000, 0.01),  # flat: the nucleus is not in the top 1024, the full sort path runs
    ],
)
def test_processing_matches_reference(
    temperature: float, top_k: int, top_p: float, min_p: float, vocab: int, scale: float
) -> None:
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * scale
    got = process_logits(
        logits,
        torch.full((3,), temperature),
        torch.full((3,), top_k, dtype=torch.long),
        torch.full((3,), top_p),
        torch.full((3,), min_p),
    )
    for row in range(3):
        want = _reference(logits[row], temperature, top_k, top_p, min_p)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want))
        finite = torch.isfinite(want)
        assert torch.allclose(got[row][finite], want[finite], atol=1e-5)


def test_sample_reports_the_logprob_of_what_it_drew_and_reproduces() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 2
    params = [
        SamplingParams(max_tokens=1, temperature=0.8, top_k=30),
        SamplingParams(max_tokens=1, temperature=1.0, top_p=0.6),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=1.3, min_p=0.1, top_logprobs=3),
    ]
    a = sample(logits, params, [make_generator(s) for s in range(4)])
    b = sample(logits, params, [make_generator(s) for s in range(4)])
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    for row, sp in enumerate(params):
        lp = _reference(logits[row], sp.temperature or 1.0, sp.top_k, sp.top_p, sp.min_p)
        tok = a.token_ids[row]
        assert torch.isfinite(lp[tok])
        assert a.logprobs[row] == pytest.approx(float(lp[tok]), abs=1e-5)
    assert a.token_ids[2] == int(torch.argmax(logits[2]))  # greedy reports the plain log-softmax
    assert a.top is not None
    assert len(a.top[3]) == 3 and a.top[0] == []
    assert [t for t, _ in a.top[3]] == torch.topk(_reference(logits[3], 1.3, 0, 1.0, 0.1), 3).indices.tolist()


def test_draws_follow_the_processed_distribution_and_respect_bans() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]]).repeat(4000, 1)
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_k=3)] * 4000
    g = [make_generator(1000 + i) for i in range(4000)]
    out = sample(logits, params, g, banned=[(4,)] * 4000)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / 4000
    # token 4 is banned, top-3 of the rest keeps 0, 1, 2
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), -1)
    assert counts[3] == 0 and counts[4] == 0
    assert torch.allclose(counts[:3], want, atol=0.03)
