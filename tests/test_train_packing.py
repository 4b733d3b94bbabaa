"""Sequence packing: layout, the block-causal mask, and packed == unpacked logprobs, loss and gradients."""

from __future__ import annotations

import pytest
import torch

from polar.train.loss import LossConfig, policy_loss
from polar.train.packing import (
    PackedBatch,
    block_causal_mask,
    pack,
    response_logprobs,
    token_logprobs,
    unpack,
)
from tests.train_support import tiny_lm

SEQS = [
    ([5, 9, 11], [20, 21, 22, 23]),
    ([7, 8], [30, 31, 32]),
    ([3, 4, 6, 12, 13], [40, 41]),
    ([2], [50]),
    ([14, 15, 16, 17], [60, 61, 62, 63, 1]),
]
MASKS = [[1, 1, 0, 1], [1, 1, 1], [0, 0], [1], [1, 0, 0, 1, 1]]


def alone(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logprobs of one trace's response with the model run on that trace only, no mask, no positions."""
    ids = torch.tensor([[*prompt, *response]])
    logits = model(input_ids=ids).logits[0]
    p = len(prompt)
    lp = logits[p - 1 : -1].log_softmax(-1)
    return lp.gather(-1, ids[0, p:, None]).squeeze(-1)


def rows_cols(b: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the logits predicting each response token sit in the packed rows, worked out by hand."""
    rows, cols = [], []
    for p in b.placements:
        for k in range(p.response_len):
            rows.append(p.row)
            cols.append(p.start + p.prompt_len - 1 + k)
    return torch.tensor(rows), torch.tensor(cols)


def test_layout_first_fit_positions_and_sequence_ids() -> None:
    b = pack(SEQS, max_len=10)
    # lengths 7, 5, 7, 2, 9: [0] then [1] does not fit row 0 -> row 1; [2] -> row 2; [3] fits row 0; [4] -> row 3
    assert [(p.row, p.start) for p in b.placements] == [(0, 0), (1, 0), (2, 0), (0, 7), (3, 0)]
    assert b.input_ids.shape == (4, 9)
    assert b.input_ids[0].tolist() == [5, 9, 11, 20, 21, 22, 23, 2, 50]
    assert b.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert b.sequence_ids[0].tolist() == [0] * 7 + [3] * 2
    # padding: pad id, its own run of positions, sequence -1
    assert b.input_ids[1].tolist() == [7, 8, 30, 31, 32, 0, 0, 0, 0]
    assert b.position_ids[1].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert b.sequence_ids[1].tolist() == [1] * 5 + [-1] * 4
    assert b.response_lengths == [4, 3, 2, 1, 5]
    assert b.seq_index.tolist() == [0] * 4 + [1] * 3 + [2] * 2 + [3] + [4] * 5


def test_pack_rejects_what_it_cannot_place_faithfully() -> None:
    with pytest.raises(ValueError, match="trace 1: 9 tokens exceed max_len 8"):
        pack([([1], [2]), ([1, 2, 3, 4], [5, 6, 7, 8, 9])], max_len=8)
    with pytest.raises(ValueError, match="trace 0: no response tokens"):
        pack([([1], [])], max_len=8)
    with pytest.raises(ValueError, match="trace 0: no prompt tokens"):
        pack([([], [1])], max_len=8)
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        pack([([1], [2])], max_len=0)


def test_block_causal_mask_keeps_attention_inside_each_trace() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = block_causal_mask(ids)
    assert m.shape == (1, 1, 6, 6)
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert (m[0, 0][m[0, 0] != 0] == torch.finfo(torch.float32).min).all()


def test_flat_and_unpack_round_trip() -> None:
    b = pack(SEQS, max_len=16)
    flat = b.flat(MASKS, torch.float32)
    assert [x.tolist() for x in unpack(flat, b)] == MASKS
    assert (
        b.flat([1.0, 2.0, 3.0, 4.0, 5.0], torch.float32).tolist()
        == [1.0] * 4 + [2.0] * 3 + [3.0] * 2 + [4.0] + [5.0] * 5
    )
    with pytest.raises(ValueError, match="got values for 2 traces, the batch packs 5"):
        b.flat([1.0, 2.0], torch.float32)
    with pytest.raises(ValueError, match="trace 1: 2 values for 3 response tokens"):
        b.flat([[1, 1, 1, 1], [1, 1], [1, 1], [1], [1] * 5], torch.float32)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("max_len", "by_positions"), [(10, False), (64, False), (10, True)])
def test_packed_logprobs_equal_each_trace_run_alone(attn: str, max_len: int, by_positions: bool) -> None:
    model = tiny_lm(attn).double()
    with torch.no_grad():
        b = pack(SEQS, max_len=max_len)
        packed = unpack(response_logprobs(model, b, by_positions=by_positions), b)
        for (prompt, response), got in zip(SEQS, packed, strict=True):
            # float64 weights, but eager attention takes its softmax in float32 (transformers' Qwen3)
            torch.testing.assert_close(got, alone(model, prompt, response), rtol=0, atol=1e-7)


def test_without_the_mask_traces_would_leak_into_each_other() -> None:
    """The equality above is not vacuous: plain causal attention over a packed row changes the logprobs."""
    model = tiny_lm("eager").double()
    with torch.no_grad():
        b = pack(SEQS, max_len=64)
        logits = model(input_ids=b.input_ids, use_cache=False).logits  # plain causal attention per row
        leaky = token_logprobs(logits[rows_cols(b)], b.targets)
        exact = response_logprobs(model, b)
    assert not torch.allclose(leaky, exact, atol=1e-3)


def test_packed_loss_and_gradients_equal_unpacked() -> None:
    model = tiny_lm("sdpa").double()
    params = [p for p in model.parameters() if p.requires_grad]
    mask_per = [torch.tensor(m, dtype=torch.float64) for m in MASKS]
    adv = [1.0, -0.5, 2.0, -1.0, 0.25]
    with torch.no_grad():  # behaviour logprobs a little off the trainer's: TIS weights differ from 1
        b = pack(SEQS, max_len=16)
        base = response_logprobs(model, b).double()
        beh = base + 0.3 * torch.sin(torch.arange(base.numel(), dtype=torch.float64))
    for aggregation in ("token_mean", "sequence_mean"):
        cfg = LossConfig(aggregation=aggregation, kl_coef=0.1)  # type: ignore[arg-type]
        weights = torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0], dtype=torch.float64)

        def loss_of(
            logp: torch.Tensor, cfg: LossConfig = cfg, weights: torch.Tensor = weights
        ) -> torch.Tensor:
            return policy_loss(
                logp,
                beh,
                b.flat(adv, torch.float64),
                torch.cat(mask_per),
                cfg,
                old_logprobs=base,
                ref_logprobs=base - 0.05,
                seq_index=b.seq_index,
                seq_weights=weights,
            )[0]

        packed_logp = response_logprobs(model, b).double()
        packed = loss_of(packed_logp)
        g_packed = torch.autograd.grad(packed, params)

        unpacked_logp = torch.cat([alone(model, p, r).double() for p, r in SEQS])
        unpacked = loss_of(unpacked_logp)
        g_unpacked = torch.autograd.grad(unpacked, params)

        assert packed.item() == pytest.approx(unpacked.item(), rel=1e-7, abs=1e-9)
        for gp, gu in zip(g_packed, g_unpacked, strict=True):
            torch.testing.assert_close(gp, gu, rtol=1e-6, atol=1e-9)


def test_temperature_scales_the_logits() -> None:
    model = tiny_lm("eager").double()
    with torch.no_grad():
        b = pack(SEQS[:1], max_len=16)
        hot = response_logprobs(model, b, temperature=2.0)
        logits = model(input_ids=b.input_ids).logits
        direct = (logits[0, 2:6] / 2.0).log_softmax(-1).gather(-1, b.input_ids[0, 3:7, None])
    torch.testing.assert_close(hot, direct.squeeze(-1), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        response_logprobs(model, b, temperature=0.0)
