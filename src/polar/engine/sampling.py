"""Sampling with logprobs of the distribution actually sampled from.

For RL the behaviour policy's logprob of each sampled token must be the probability under the *processed*
distribution (after temperature, top-k, top-p, min-p), the way vLLM reports it with
`--logprobs-mode processed_logprobs`. transformers' `generate(output_scores=True)` does not give that
reliably (its scores are post-processor logits: with top-k 50 every logprob came out near -ln 50), so the
processing is done here, explicitly, in float32, and the very same tensor is used to draw the token and to
report its logprob.

Greedy rows (temperature 0) report the unprocessed log-softmax, as vLLM does: a point mass would give 0.0
for every token, which is useless to a trainer.

Each sequence draws from its own `torch.Generator`, so a seeded request reproduces whatever else is in the
batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GREEDY_EPS = 1e-5
# Nucleus candidates tried before falling back to a full sort: a real model's top-p set is almost always
# inside its top 1024 tokens; a flat distribution (the random tiny model) needs the sort.
_TOP_P_CANDIDATES = 1024


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One sequence's sampling settings (a request with n > 1 becomes n of these, seeds seed+i)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    top_logprobs: int = 0
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Log-probabilities [B, V] of the processed distribution (masked tokens are -inf)."""
    return torch.log_softmax(processed_scores(logits, temperature, top_k, top_p, min_p), dim=1)


def processed_scores(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature-scaled logits with the tokens top-k/top-p/min-p exclude set to -inf (unnormalized).

    `temperature`, `top_p`, `min_p` are float [B]; `top_k` is long [B] with 0 meaning off. Rows with
    temperature ~0 get the plain log-softmax (see module doc).
    """
    x = logits.float()
    greedy = temperature < _GREEDY_EPS
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    x = x / temp.unsqueeze(1)
    vocab = x.shape[1]
    k = torch.where(greedy, torch.zeros_like(top_k), top_k).clamp(min=0, max=vocab)
    if bool((k > 0).any()):
        kmax = int(k.max())
        vals = torch.topk(x, kmax, dim=1).values
        kth = vals.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
        x = torch.where((k > 0).unsqueeze(1) & (x < kth), float("-inf"), x)
    p = torch.where(greedy, torch.ones_like(top_p), top_p).float()
    mp = torch.where(greedy, torch.zeros_like(min_p), min_p).float()
    if bool((p < 1.0).any()) or bool((mp > 0.0).any()):
        probs = torch.softmax(x, dim=1)
        if bool((mp > 0.0).any()):
            floor = probs.max(dim=1, keepdim=True).values * mp.unsqueeze(1)
            x = torch.where(probs < floor, float("-inf"), x)
            probs = torch.softmax(x, dim=1)
        rows = torch.nonzero(p < 1.0).flatten().tolist()
        if rows:
            thr = torch.stack([_nucleus_threshold(probs[r], float(p[r])) for r in rows])
            sub = x[rows]
            x[rows] = torch.where(probs[rows] < thr.unsqueeze(1), float("-inf"), sub)
    return x


def _nucleus_threshold(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Smallest probability kept by top-p: the minimal top set whose mass reaches p (ties kept)."""
    k = min(_TOP_P_CANDIDATES, probs.numel())
    vals = torch.topk(probs, k).values
    cums = torch.cumsum(vals, dim=0)
    if float(cums[-1]) < p and k < probs.numel():
        vals = torch.sort(probs, descending=True).values
        cums = torch.cumsum(vals, dim=0)
    idx = int(
        torch.searchsorted(cums, torch.tensor([p], dtype=cums.dtype, device=cums.device)).clamp(
            max=vals.numel() - 1
        )
    )
    return vals[idx]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    banned: list[tuple[int, ...]] | None = None,
) -> SampleOutput:
    """Sample one token per row; return ids, their processed logprobs and, when asked, top logprobs."""
    bsz = logits.shape[0]
    logits = logits.float()
    if banned is not None and any(banned):
        logits = logits.clone()
        for row, ban in enumerate(banned):
            if ban:
                logits[row, list(ban)] = float("-inf")
    cpu = torch.device("cpu")
    temperature = torch.tensor([sp.temperature for sp in params], dtype=torch.float32, device=cpu)
    top_k = torch.tensor([sp.top_k if sp.top_k > 0 else 0 for sp in params], dtype=torch.long, device=cpu)
    top_p = torch.tensor([sp.top_p for sp in params], dtype=torch.float32, device=cpu)
    min_p = torch.tensor([sp.min_p for sp in params], dtype=torch.float32, device=cpu)
    dev = logits.device
    x = processed_scores(logits, temperature.to(dev), top_k.to(dev), top_p.to(dev), min_p.to(dev))
    # One pass each for max, exp, cumsum and sum instead of a full log-softmax: the vocabulary is most of
    # the work of a small model's step. logprob(t) = x_t - max - log(sum exp(x - max)).
    peak, argmax = torch.max(x, dim=1, keepdim=True)
    weights = torch.exp(x - peak)
    cdf = torch.cumsum(weights, dim=1)
    log_total = torch.log(weights.sum(dim=1, keepdim=True))
    uniforms = torch.cat([torch.rand(1, generator=g) for g in generators]).to(dev)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    ids = torch.searchsorted(cdf, target, right=True).clamp(max=x.shape[1] - 1)
    # Float edge: a target on the last plateau can land on a masked token; fall back to the mode.
    ids = torch.where(torch.isfinite(x.gather(1, ids)), ids, argmax)
    greedy = (temperature < _GREEDY_EPS).to(dev).unsqueeze(1)
    ids = torch.where(greedy, argmax, ids)
    chosen = (x.gather(1, ids) - peak - log_total).squeeze(1)
    ids = ids.squeeze(1)
    top: list[list[tuple[int, float]]] | None = None
    n_top = max((sp.top_logprobs for sp in params), default=0)
    if n_top > 0:
        vals, idx = torch.topk(x - peak - log_total, min(n_top, x.shape[1]), dim=1)
        vals_l, idx_l = vals.cpu().tolist(), idx.cpu().tolist()
        top = [
            list(zip(idx_l[r][: params[r].top_logprobs], vals_l[r][: params[r].top_logprobs], strict=True))
            for r in range(bsz)
        ]
    return SampleOutput(ids.cpu().tolist(), chosen.cpu().tolist(), top)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator per sequence; unseeded sequences get fresh OS entropy."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g
