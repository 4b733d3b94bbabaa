"""Data-parallel training: `torchrun --nproc_per_node N -m polar train CONFIG`.

Rank 0 runs everything `polar train` runs alone (the rollout server, the node, the policy server, the
loop, the weight sync); at each step it splits the batch's traces over the ranks (longest first, to the rank
with the fewest tokens) and broadcasts the shards with the step's global loss denominator. Every rank runs
the same `Trainer.step` on its shard, its policy wrapped in torch's `DistributedDataParallel`: gradients
accumulate locally over micro-batches (`no_sync`) and are all-reduced once, with the last one. Each rank
scales its loss by the world size, so DDP's average is the sum of the shards' gradients, each normalized by
the *global* denominator: the update equals the single-process update on the whole batch (up to the order
of floating-point sums), and clipping and AdamW then run identically everywhere.

Backends: `gloo` on CPU (tested here with 2 processes), `nccl` on GPUs (each rank on `cuda:LOCAL_RANK`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class World:
    rank: int
    size: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def from_env() -> World | None:
    """The process group torchrun describes (`WORLD_SIZE` > 1), joined; None for a single process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return None
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return World(rank, size, local)


def shard(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Indices per rank: longest first, each to the rank with the fewest tokens so far (ties: lowest
    rank), every rank's list in the batch's order."""
    loads = [0] * size
    out: list[list[int]] = [[] for _ in range(size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(size), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += lengths[i]
    return [sorted(idx) for idx in out]


def broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sum_all(values: Sequence[float], device: torch.device) -> list[float]:
    """The element-wise sum of `values` over the ranks."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]
