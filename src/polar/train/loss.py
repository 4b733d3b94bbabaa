"""Token-level PPO-clip with asymmetric clipping, truncated importance sampling and an optional k3 KL.

All inputs are per-token tensors of one shape (flat `(N,)` from `polar.train.packing`, or padded `(B, T)`),
holding only response tokens; `mask` is the trace's `loss_mask` (1 = sampled by the policy, trainable).
For each token with current logprob logp, old-policy logprob old, behaviour logprob beh (what the inference
server reported when it sampled the token: `Trace.response_logprobs`) and advantage A:

    ratio = exp(logp - old)
    pg    = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)       (DAPO's clip-higher: 0.2 / 0.28)
    tis   = min(exp(old - beh), tis_cap), detached                                (truncated IS)
    kl    = exp(ref - logp) - (ref - logp) - 1                                    (k3, Schulman's estimator)
    loss_token = tis * pg + kl_coef * kl

TIS is Yao et al.'s correction ("Your efficient RL framework secretly brings you off-policy RL training"):
the trainer's own old policy pi_old and the sampler's pi_beh differ (other kernels, precision, and here
also staleness from async rollouts), so the PPO term, whose ratio is taken against the trainer's pi_old, is
reweighted by the capped ratio pi_old / pi_beh. With one optimizer step per batch, pi_old is the current
policy before the step: pass `old_logprobs=logprobs.detach()` (no extra forward). Without `old_logprobs`
the behaviour logprobs ARE the old policy (the "bypass" form: the trust region is measured from the policy
that sampled) and the TIS weight is 1.

Aggregation (masked tokens never count, in numerator or denominator):
    token_mean     sum(mask * loss_token) / sum(mask): every sampled token once, however a session was
                   split into traces, so per_request and prefix_merging traces of a session give one loss.
    sequence_mean  sum_s w_s * mean_{t in s}(loss_token) / sum_s w_s over sequences with a trainable
                   token; w_s is the per-trajectory weight (1 / traces of its trajectory), so each
                   trajectory counts once.
`denominator` replaces the sum(mask) or sum(w_s) with a batch-wide count, so that gradient accumulation over
micro-batches adds up to the loss of the whole batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token_mean", "sequence_mean"]

# exp() of a log-ratio past this overflows float32 gradients into inf * 0 = NaN; verl clamps the same way.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True, slots=True)
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float | None = 2.0  # None: no TIS weight
    kl_coef: float = 0.0
    aggregation: Aggregation = "token_mean"

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.aggregation not in ("token_mean", "sequence_mean"):
            raise ValueError(f"aggregation must be token_mean or sequence_mean, got {self.aggregation!r}")


@dataclass(frozen=True, slots=True)
class LossMetrics:
    """Means over the trainable tokens of the batch (0.0 when there are none)."""

    clip_fraction: float  # tokens whose clipped branch is active (zero policy gradient)
    ratio_mean: float
    tis_mean: float  # the TIS weight actually applied (after the cap)
    tis_capped_fraction: float  # tokens where the cap was reached
    kl: float  # k3 to the reference; 0.0 without one
    tokens: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    n = mask.sum()
    return float((x * mask).sum() / n) if n > 0 else 0.0


def _aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: Aggregation,
    seq_index: Tensor | None,
    seq_weights: Tensor | None,
    denominator: float | None,
) -> Tensor:
    total = torch.where(mask, per_token, 0.0)
    if aggregation == "token_mean":
        n = denominator if denominator is not None else mask.sum().clamp(min=1)
        return total.sum() / n
    if seq_index is None:
        raise ValueError("sequence_mean needs seq_index (the sequence of each token)")
    seq = seq_index.reshape(-1).long()
    n_seq = int(seq.max()) + 1 if seq.numel() else 0
    sums = torch.zeros(n_seq, dtype=total.dtype, device=total.device).index_add(0, seq, total.reshape(-1))
    counts = torch.zeros(n_seq, dtype=total.dtype, device=total.device)
    counts = counts.index_add(0, seq, mask.reshape(-1).to(total.dtype))
    w = torch.ones(n_seq, dtype=total.dtype, device=total.device)
    if seq_weights is not None:
        w = seq_weights.to(total.dtype)[:n_seq]
    w = torch.where(counts > 0, w, 0.0)  # a sequence with nothing trainable weighs nothing
    per_seq = sums / counts.clamp(min=1)
    n = denominator if denominator is not None else w.sum().clamp(min=torch.finfo(total.dtype).tiny)
    return (w * per_seq).sum() / n


def policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig = LossConfig(),
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    seq_index: Tensor | None = None,
    seq_weights: Tensor | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, LossMetrics]:
    """The scalar loss to minimize and its metrics; see the module doc for the formulas.

    `mask` is 0/1 per token. `advantages` is per token (a trace's advantage repeated over its tokens);
    `seq_index` gives each token's sequence (0..S-1) and `seq_weights` (S,) each sequence's weight, both
    used by sequence_mean only (token_mean already counts each sampled token once).
    Masked positions contribute exactly nothing: their values are replaced before any exp, so a -inf or
    garbage logprob there yields neither NaN nor gradient.
    """
    keep = mask.bool()
    old = behaviour_logprobs if old_logprobs is None else old_logprobs
    log_ratio = torch.where(keep, logprobs - old.detach(), 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = torch.where(keep, advantages, 0.0).detach()
    clipped = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)

    tis = torch.ones_like(ratio)
    if old_logprobs is not None and config.tis_cap is not None:
        mismatch = torch.where(keep, old_logprobs - behaviour_logprobs, 0.0).detach()
        tis = torch.exp(mismatch.clamp(max=_MAX_LOG_RATIO)).clamp(max=config.tis_cap)
    per_token = tis * pg

    kl = torch.zeros_like(ratio)
    if ref_logprobs is not None:
        d = torch.where(keep, ref_logprobs.detach() - logprobs, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.exp(d) - d - 1.0
        if config.kl_coef:
            per_token = per_token + config.kl_coef * kl

    loss = _aggregate(per_token, keep, config.aggregation, seq_index, seq_weights, denominator)

    with torch.no_grad():
        m = keep.to(ratio.dtype)
        was_clipped = ((adv > 0) & (ratio > 1.0 + config.eps_high)) | (
            (adv < 0) & (ratio < 1.0 - config.eps_low)
        )
        capped = tis >= config.tis_cap if config.tis_cap is not None and old_logprobs is not None else None
        metrics = LossMetrics(
            clip_fraction=_masked_mean(was_clipped.to(m.dtype), m),
            ratio_mean=_masked_mean(ratio, m),
            tis_mean=_masked_mean(tis, m),
            tis_capped_fraction=_masked_mean(capped.to(m.dtype), m) if capped is not None else 0.0,
            kl=_masked_mean(kl, m),
            tokens=int(keep.sum()),
        )
    return loss, metrics
