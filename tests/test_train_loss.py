"""The PPO-clip / TIS / k3 loss: gradient direction on a tiny causal LM, masking, bounds, aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from polar.train.advantages import trajectory_advantages
from polar.train.loss import LossConfig, policy_loss
from polar.train.packing import PackedBatch, pack, response_logits, response_logprobs, token_logprobs
from polar.trajectory import Trace, Trajectory
from tests.train_support import tiny_lm

LN = math.log


def leaf(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


# ---- on a tiny causal LM ---------------------------------------------------------------------------


SEQS = [([5, 9, 11], [20, 21, 22, 23]), ([7, 8], [30, 31, 32]), ([3, 4, 6], [40, 41])]
MASKS = [[1, 1, 0, 1], [1, 1, 1], [0, 0]]  # a tool-output token in trace 0; trace 2 fully masked


def forward(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, PackedBatch]:
    batch = pack(SEQS, max_len=32)
    logits = response_logits(model, batch)
    if logits.requires_grad:
        logits.retain_grad()
    return token_logprobs(logits, batch.targets), logits, batch


def test_one_step_raises_positive_and_lowers_negative_advantage_tokens() -> None:
    model = tiny_lm()
    logp, _, batch = forward(model)
    mask = batch.flat(MASKS, torch.float32)
    adv = batch.flat([1.0, -1.0, 1.0], torch.float32)
    behaviour = logp.detach()  # on-policy: sampled by these very weights
    loss, metrics = policy_loss(logp, behaviour, adv, mask)
    assert metrics.tokens == 6 and metrics.ratio_mean == pytest.approx(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        after, _, _ = forward(model)
    delta = (after - behaviour).split(batch.response_lengths)
    pos = delta[0][torch.tensor(MASKS[0]).bool()]
    neg = delta[1]
    assert (pos > 0).all(), pos
    assert (neg < 0).all(), neg


def test_masked_tokens_get_exactly_zero_gradient_on_the_model() -> None:
    model = tiny_lm()
    logp, logits, batch = forward(model)
    logp.retain_grad()
    mask = batch.flat(MASKS, torch.float32)
    adv = batch.flat([1.0, -1.0, 1.0], torch.float32)
    loss, _ = policy_loss(logp, logp.detach() - 0.1, adv, mask, old_logprobs=logp.detach())
    loss.backward()
    assert logp.grad is not None and logits.grad is not None
    assert (logp.grad[mask == 0] == 0).all()
    assert (logp.grad[mask == 1] != 0).all()
    # The logits that predict a masked token receive nothing; those predicting a trainable one do.
    assert ((logits.grad != 0).any(-1) == mask.bool()).all()


def test_a_fully_masked_trace_changes_neither_loss_nor_gradient() -> None:
    logp = leaf([-1.0, -2.0, -0.5, -3.0, -0.2])
    beh = t([-1.1, -1.9, 7.0, 0.0, -0.3])
    adv = t([1.0, 1.0, 5.0, 5.0, -1.0])
    seq = torch.tensor([0, 0, 1, 1, 2])
    mask = t([1, 1, 0, 0, 1])
    for agg in ("token_mean", "sequence_mean"):
        cfg = LossConfig(aggregation=agg)  # type: ignore[arg-type]
        with_it, _ = policy_loss(logp, beh, adv, mask, cfg, seq_index=seq)
        keep = torch.tensor([0, 1, 4])
        without, _ = policy_loss(logp[keep], beh[keep], adv[keep], mask[keep], cfg, seq_index=t([0, 0, 1]))
        assert with_it.item() == pytest.approx(without.item())
        assert (grad_of(with_it, logp)[2:4] == 0).all()


def test_garbage_at_masked_positions_gives_no_nan() -> None:
    logp = leaf([-1.0, -math.inf, -0.5])
    beh = t([-1.0, 50.0, -math.inf])
    mask = t([1, 0, 0])
    ref = t([-1.0, math.inf, -math.inf])
    loss, m = policy_loss(
        logp, beh, t([1.0, 1.0, 1.0]), mask, LossConfig(kl_coef=0.1), old_logprobs=beh, ref_logprobs=ref
    )
    g = grad_of(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert g.tolist() == [pytest.approx(-1.0), 0.0, 0.0]
    assert math.isfinite(m.tis_mean) and math.isfinite(m.kl) and m.tokens == 1


# ---- clipping and TIS at their bounds ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "advantage", "clipped"),
    [
        (1.5, 1.0, True),  # above 1 + eps_high with A > 0: no push further up
        (1.5, -1.0, False),  # above with A < 0: pulled back
        (1.25, 1.0, False),  # inside the asymmetric high bound (a symmetric 0.2 would clip)
        (1.29, 1.0, True),
        (0.79, -1.0, True),  # below 1 - eps_low with A < 0: no push further down
        (0.79, 1.0, False),
        (0.81, -1.0, False),
    ],
)
def test_ppo_clip_bounds(ratio: float, advantage: float, clipped: bool) -> None:
    logp = leaf([-1.0])
    beh = t([-1.0 - LN(ratio)])
    loss, m = policy_loss(logp, beh, t([advantage]), t([1.0]))
    g = grad_of(loss, logp)
    assert m.clip_fraction == (1.0 if clipped else 0.0)
    assert m.ratio_mean == pytest.approx(ratio)
    if clipped:
        assert g.item() == 0.0
    else:  # d/dlogp of -ratio * A
        assert g.item() == pytest.approx(-ratio * advantage)


def test_tis_weight_is_the_capped_old_over_behaviour_ratio_and_detached() -> None:
    logp = leaf([-1.0, -1.0, -1.0])
    old = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    beh = t([-1.0 - LN(1.5), -1.0 - LN(5.0), -1.0 + LN(2.0)])  # weights 1.5, 5 -> cap 2, 0.5
    loss, m = policy_loss(logp, beh, t([1.0, 1.0, 1.0]), t([1, 1, 1]), old_logprobs=old)
    g_logp, g_old = torch.autograd.grad(loss, [logp, old], allow_unused=True)
    assert g_logp.tolist() == pytest.approx([-1.5 / 3, -2.0 / 3, -0.5 / 3])
    assert g_old is None or (g_old == 0).all()  # neither the ratio's nor TIS's old side is trained
    assert m.tis_mean == pytest.approx((1.5 + 2.0 + 0.5) / 3)
    assert m.tis_capped_fraction == pytest.approx(1 / 3)


def test_tis_cap_is_configurable_and_can_be_off() -> None:
    logp, old, beh = leaf([-1.0]), t([-1.0]), t([-1.0 - LN(5.0)])
    for cap, weight in ((3.0, 3.0), (10.0, 5.0), (None, 1.0)):
        loss, m = policy_loss(logp, beh, t([1.0]), t([1.0]), LossConfig(tis_cap=cap), old_logprobs=old)
        assert grad_of(loss, logp).item() == pytest.approx(-weight)
        assert m.tis_mean == pytest.approx(weight)


def test_without_old_logprobs_the_ratio_is_against_behaviour_and_tis_is_one() -> None:
    logp, beh = leaf([-1.0]), t([-1.0 - LN(1.1)])
    loss, m = policy_loss(logp, beh, t([2.0]), t([1.0]))
    assert m.ratio_mean == pytest.approx(1.1) and m.tis_mean == 1.0
    assert grad_of(loss, logp).item() == pytest.approx(-2.2)


def test_k3_kl_value_and_gradient() -> None:
    logp, ref = leaf([-1.0, -2.0]), t([-1.5, -2.0])
    loss, m = policy_loss(
        logp, logp.detach(), t([0.0, 0.0]), t([1, 1]), LossConfig(kl_coef=0.5), ref_logprobs=ref
    )
    d = -0.5  # ref - logp on the first token; 0 on the second
    assert m.kl == pytest.approx((math.exp(d) - d - 1) / 2)
    assert loss.item() == pytest.approx(0.5 * m.kl)
    # d/dlogp of exp(ref - logp) - (ref - logp) - 1 = 1 - exp(ref - logp)
    assert grad_of(loss, logp).tolist() == pytest.approx([0.5 * (1 - math.exp(d)) / 2, 0.0])
    no_coef, m0 = policy_loss(logp, logp.detach(), t([0.0, 0.0]), t([1, 1]), ref_logprobs=ref)
    assert no_coef.item() == 0.0 and m0.kl == pytest.approx(m.kl)  # reported, not trained


# ---- aggregation ------------------------------------------------------------------------------------


def per_token_losses() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = leaf([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    adv = t([1.0, 1.0, 1.0, -2.0, -2.0, 3.0])  # on-policy: each token's loss is -A
    seq = torch.tensor([0, 0, 0, 1, 1, 2])
    mask = t([1, 1, 0, 1, 1, 1])
    return logp, logp.detach(), adv, mask, seq


def test_token_mean_averages_over_all_trainable_tokens() -> None:
    logp, beh, adv, mask, _ = per_token_losses()
    loss, m = policy_loss(logp, beh, adv, mask)
    assert loss.item() == pytest.approx(-(1 + 1 - 2 - 2 + 3) / 5)
    assert m.tokens == 5


def test_sequence_mean_weights_each_sequence() -> None:
    logp, beh, adv, mask, seq = per_token_losses()
    cfg = LossConfig(aggregation="sequence_mean")
    loss, _ = policy_loss(logp, beh, adv, mask, cfg, seq_index=seq)
    assert loss.item() == pytest.approx(-(1 - 2 + 3) / 3)
    w = t([0.5, 0.5, 1.0])  # sequences 0 and 1 are two traces of one trajectory
    loss, _ = policy_loss(logp, beh, adv, mask, cfg, seq_index=seq, seq_weights=w)
    assert loss.item() == pytest.approx(-(0.5 * 1 + 0.5 * -2 + 3) / 2)
    with pytest.raises(ValueError, match="sequence_mean needs seq_index"):
        policy_loss(logp, beh, adv, mask, cfg)


def test_split_session_counts_once_under_both_aggregations() -> None:
    """One session as one trace vs as three traces (weights 1/3), next to a one-trace session."""
    logp = leaf([-1.0] * 8)
    adv = t([1.0] * 6 + [-1.0] * 2)
    mask = t([1] * 8)
    merged = torch.tensor([0] * 6 + [1] * 2)
    split = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    tok = LossConfig()
    seq = LossConfig(aggregation="sequence_mean")
    a, _ = policy_loss(logp, logp.detach(), adv, mask, tok, seq_index=merged)
    b, _ = policy_loss(logp, logp.detach(), adv, mask, tok, seq_index=split)
    assert a.item() == pytest.approx(b.item())
    a, _ = policy_loss(logp, logp.detach(), adv, mask, seq, seq_index=merged, seq_weights=t([1, 1]))
    w = t([1 / 3, 1 / 3, 1 / 3, 1])
    b, _ = policy_loss(logp, logp.detach(), adv, mask, seq, seq_index=split, seq_weights=w)
    assert a.item() == pytest.approx(b.item()) == 0.0  # +1 and -1 sessions, each one unit


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_micro_batches_with_a_global_denominator_add_up_to_the_batch(aggregation: str) -> None:
    logp, beh, adv, mask, seq = per_token_losses()
    cfg = LossConfig(aggregation=aggregation)  # type: ignore[arg-type]
    full, _ = policy_loss(logp, beh, adv, mask, cfg, seq_index=seq)
    denom = 5.0 if aggregation == "token_mean" else 3.0
    first, second = slice(0, 3), slice(3, 6)
    parts = [
        policy_loss(logp[s], beh[s], adv[s], mask[s], cfg, seq_index=seq[s] - seq[s][0], denominator=denom)[0]
        for s in (first, second)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())


def test_all_masked_batch_is_zero_with_zero_gradient() -> None:
    logp = leaf([-1.0, -2.0])
    for agg in ("token_mean", "sequence_mean"):
        cfg = LossConfig(aggregation=agg)  # type: ignore[arg-type]
        loss, m = policy_loss(logp, t([0.0, 0.0]), t([1.0, 1.0]), t([0, 0]), cfg, seq_index=t([0, 1]))
        assert loss.item() == 0.0 and m.tokens == 0 and m.clip_fraction == 0.0
        assert (grad_of(loss, logp) == 0).all()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(eps_low=1.0)
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="aggregation"):
        LossConfig(aggregation="sum")  # type: ignore[arg-type]


# ---- the pieces together: trajectories -> advantages -> packed logprobs -> loss ------------------------


def batch_loss(
    model: torch.nn.Module, trajectories: list[Trajectory], cfg: LossConfig = LossConfig()
) -> torch.Tensor:
    advs, _ = trajectory_advantages(trajectories, "rloo")
    traces = [tr for t in trajectories for tr in t.traces]
    batch = pack([(tr.prompt_ids, tr.response_ids) for tr in traces], max_len=64)
    logp = response_logprobs(model, batch)
    loss, _ = policy_loss(
        logp,
        batch.flat([tr.response_logprobs or [] for tr in traces], logp.dtype),
        batch.flat([a.advantage for a in advs], logp.dtype),
        batch.flat([tr.loss_mask for tr in traces], logp.dtype),
        cfg,
        old_logprobs=logp.detach(),
        seq_index=batch.seq_index,
        seq_weights=torch.tensor([a.weight for a in advs]),
    )
    return loss


def test_per_request_and_prefix_merging_traces_of_a_session_give_one_token_mean_loss() -> None:
    """One session as one merged trace (tool output masked) or as one trace per call: same loss, same
    gradient, because every sampled token is counted once with its trajectory's advantage."""
    model = tiny_lm()
    prompt, first, tool, second = [5, 9, 11], [20, 21], [33, 34], [22, 23, 24]
    with torch.no_grad():  # behaviour logprobs: the model's own, nudged so TIS weights are not all 1
        solo = pack([(prompt, [*first, *tool, *second]), ([7, 8], [30, 31, 32])], max_len=64)
        lp = (response_logprobs(model, solo) - 0.1).tolist()
    beh_session, beh_other = lp[:7], lp[7:]
    meta = {"task_id": "t", "masked": False}

    def trace(p: list[int], r: list[int], mask: list[int], beh: list[float], reward: float) -> Trace:
        return Trace(
            prompt_ids=p,
            response_ids=r,
            loss_mask=mask,
            response_logprobs=[b if m else 0.0 for b, m in zip(beh, mask, strict=True)],
            reward=reward,
        )

    other = Trajectory(
        traces=[trace([7, 8], [30, 31, 32], [1, 1, 1], beh_other, 0.0)], metadata={**meta, "reward": 0.0}
    )
    merged = Trajectory(
        traces=[trace(prompt, [*first, *tool, *second], [1, 1, 0, 0, 1, 1, 1], beh_session, 1.0)],
        metadata={**meta, "reward": 1.0},
    )
    split = Trajectory(
        traces=[
            trace(prompt, first, [1, 1], beh_session[:2], 1.0),
            trace([*prompt, *first, *tool], second, [1, 1, 1], beh_session[4:], 1.0),
        ],
        metadata={**meta, "reward": 1.0},
    )
    params = list(model.parameters())
    a = batch_loss(model, [merged, other])
    ga = torch.autograd.grad(a, params)
    b = batch_loss(model, [split, other])
    gb = torch.autograd.grad(b, params)
    assert a.item() == pytest.approx(b.item(), rel=1e-5)
    assert a.item() != 0.0
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)
    # sequence_mean weights the split session's two traces 1/2 each: still finite, one unit
    assert torch.isfinite(batch_loss(model, [split, other], LossConfig(aggregation="sequence_mean")))
