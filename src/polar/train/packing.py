"""Sequence packing: several traces per row, each seeing only itself, and the logprobs of their responses.

A trace is `prompt_ids + response_ids`. Packing lays traces end to end in rows of at most `max_len` tokens
(first fit, in order), with position ids restarting at 0 for each trace and a per-token sequence index
(-1 for padding). Attention must stay inside a trace:
- on eager / SDPA attention, `response_logits` passes the 4D additive block-causal mask, which
  `transformers` uses as given (5.x `masking_utils`: "already prepared 4D mask ... returned as-is");
- on flash-attention it passes no mask and lays all rows end to end in ONE row: `transformers` runs the
  varlen kernel with boundaries where the position ids restart, and only for a batch of one row
  (`modeling_flash_attention_utils._is_packed_sequence`).
Either way each trace gets the logits it would get alone. (Models with sliding-window layers would need the
window in the mask too; the 4D path does not model it.)

Only the positions that predict a response token are projected onto the vocabulary (`logits_to_keep`), so
memory is about N x vocab for N response tokens, not rows x length x vocab. Everything per token is flat,
in trace order: what `polar.train.loss.policy_loss` takes, with `PackedBatch.seq_index`; `unpack` splits a
flat tensor back per trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Placement:
    row: int
    start: int  # column of the trace's first prompt token
    prompt_len: int
    response_len: int


@dataclass(frozen=True, slots=True)
class PackedBatch:
    input_ids: Tensor  # (R, L) long, pad_id after the last trace of a row
    position_ids: Tensor  # (R, L) long, restarting at 0 per trace (and once for the padding)
    sequence_ids: Tensor  # (R, L) long, index of the trace at each position, -1 for padding
    placements: tuple[Placement, ...]  # one per trace, in input order

    @property
    def response_lengths(self) -> list[int]:
        return [p.response_len for p in self.placements]

    @property
    def seq_index(self) -> Tensor:
        """(N,) trace index of every response token in the flat layout (for sequence_mean)."""
        lengths = torch.tensor(self.response_lengths, dtype=torch.long)
        return torch.repeat_interleave(torch.arange(len(self.placements)), lengths)

    @property
    def targets(self) -> Tensor:
        """(N,) the response tokens, flat in trace order."""
        return torch.cat(
            [
                self.input_ids[p.row, p.start + p.prompt_len : p.start + p.prompt_len + p.response_len]
                for p in self.placements
            ]
        )

    def flat(self, per_trace: Sequence[Sequence[float] | float], dtype: torch.dtype) -> Tensor:
        """(N,) tensor in the flat response layout: per-token lists are concatenated, a per-trace scalar
        (an advantage) is repeated over its trace's response tokens."""
        lengths = self.response_lengths
        if len(per_trace) != len(lengths):
            raise ValueError(f"got values for {len(per_trace)} traces, the batch packs {len(lengths)}")
        parts: list[Tensor] = []
        for i, (v, n) in enumerate(zip(per_trace, lengths, strict=True)):
            if isinstance(v, int | float):
                parts.append(torch.full((n,), float(v), dtype=dtype))
                continue
            if len(v) != n:
                raise ValueError(f"trace {i}: {len(v)} values for {n} response tokens")
            parts.append(torch.tensor(list(v), dtype=dtype))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def pack(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int, pad_id: int = 0
) -> PackedBatch:
    """Pack (prompt_ids, response_ids) pairs into rows of at most `max_len` tokens, first fit in input order.

    A trace longer than `max_len` is an error, never truncated: cutting it would train on tokens without
    the context they were sampled in.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    rows: list[list[int]] = []  # trace indices per row
    used: list[int] = []
    placements: list[Placement] = []
    for i, (prompt, response) in enumerate(sequences):
        n = len(prompt) + len(response)
        if not response:
            raise ValueError(f"trace {i}: no response tokens")
        if not prompt:
            raise ValueError(f"trace {i}: no prompt tokens (the first response token needs a context)")
        if n > max_len:
            raise ValueError(f"trace {i}: {n} tokens exceed max_len {max_len}")
        row = next((r for r, u in enumerate(used) if u + n <= max_len), None)
        if row is None:
            row = len(rows)
            rows.append([])
            used.append(0)
        placements.append(Placement(row, used[row], len(prompt), len(response)))
        rows[row].append(i)
        used[row] += n

    width = max(used, default=0)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    sequence_ids = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, members in enumerate(rows):
        for i in members:
            p = placements[i]
            prompt, response = sequences[i]
            n = p.prompt_len + p.response_len
            cols = slice(p.start, p.start + n)
            input_ids[r, cols] = torch.tensor([*prompt, *response], dtype=torch.long)
            position_ids[r, cols] = torch.arange(n)
            sequence_ids[r, cols] = i
        position_ids[r, used[r] :] = torch.arange(width - used[r])
    return PackedBatch(input_ids, position_ids, sequence_ids, tuple(placements))


def block_causal_mask(sequence_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(R, 1, L, L) additive mask: 0 where query and key are in one trace and the key is not later, else
    the dtype's minimum (finite, so a fully masked row cannot turn softmax into NaN)."""
    same = sequence_ids[:, :, None] == sequence_ids[:, None, :]
    length = sequence_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=sequence_ids.device).tril()
    allowed = same & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=sequence_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


# `model`: a transformers causal LM (peft-wrapped under LoRA) or its DDP wrapper; Any as in
# `polar.train.trainer.Trainer`: transformers and peft give it attributes nn.Module does not declare.
def _is_flash(model: Any) -> bool:
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash_attention")


def response_logits(model: Any, batch: PackedBatch, by_positions: bool | None = None) -> Tensor:
    """(N, vocab) logits of a `transformers` causal LM, the row that predicts each response token, flat in
    trace order (the logits at position t predict token t + 1).

    `by_positions` (default: on for flash-attention) lays the rows end to end and lets `transformers` find
    the traces from the restarting position ids instead of passing a 4D mask; transformers 5 does this for
    SDPA / eager too (`find_packed_sequence_indices`), which is how the path is tested without a GPU.
    """
    base = getattr(model, "module", model)  # a DistributedDataParallel wraps the model: forward through it
    device = next(base.parameters()).device
    width = batch.input_ids.shape[1]
    rows = torch.cat([torch.full((p.response_len,), p.row) for p in batch.placements])
    cols = torch.cat([torch.arange(p.response_len) + p.start + p.prompt_len - 1 for p in batch.placements])
    args: dict[str, Any] = {"use_cache": False}  # with a cache, transformers also stops reading packing
    if _is_flash(base) if by_positions is None else by_positions:
        args["input_ids"] = batch.input_ids.reshape(1, -1).to(device)
        args["position_ids"] = batch.position_ids.reshape(1, -1).to(device)
        cols, rows = rows * width + cols, torch.zeros_like(rows)
    else:
        args["input_ids"] = batch.input_ids.to(device)
        args["position_ids"] = batch.position_ids.to(device)
        args["attention_mask"] = block_causal_mask(batch.sequence_ids.to(device), base.dtype)
    keep = cols.unique()  # sorted; one set of columns for every row
    logits = model(**args, logits_to_keep=keep.to(device)).logits  # (rows, len(keep), vocab)
    picked: Tensor = logits[rows.to(device), torch.searchsorted(keep, cols).to(device)]
    return picked


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[target] per row, in float32 or wider.

    `temperature` must be the sampling temperature: the behaviour logprobs these are compared with are
    of logits / temperature. bf16 / fp16 logits are upcast, as their rounding alone moves a logprob by more
    than the rollout-training mismatch TIS corrects for.
    """
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return x.gather(-1, targets.to(x.device)[:, None]).squeeze(-1) - x.logsumexp(-1)


def response_logprobs(
    model: Any, batch: PackedBatch, temperature: float = 1.0, by_positions: bool | None = None
) -> Tensor:
    """(N,) logprobs of every response token under `model`, flat in trace order."""
    if not batch.placements:
        return torch.zeros(0)
    return token_logprobs(response_logits(model, batch, by_positions), batch.targets, temperature)


def unpack(flat: Tensor, batch: PackedBatch) -> list[Tensor]:
    """Split a flat (N,) per-response-token tensor back into one tensor per trace."""
    return list(flat.split(batch.response_lengths))
