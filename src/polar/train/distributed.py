"""Data-parallel training: `torchrun --nproc_per_node N -m polar train CONFIG`.

Rank 0 runs everything `polar train` runs alone (the rollout server, the node, the policy server, the
loop, the weight sync); at each step it splits the batch's traces over the ranks (longest first, to the rank
with the fewest tokens) and broadcasts the shards with the step's global loss denominator. Every rank runs
the same `Trainer.step` on its shard, its policy wrapped in torch's `DistributedDataParallel`: gradients
accumulate locally over micro-batches (`no_sync`) and are all-reduced once, with the last one. Each rank
scales its loss by the world size, so DDP's average is the sum of the shards' gradients, each normalized by
the *global* denominator: the update equals the single-process update on the whole batch (up to the order
of floating-point sums), and clipping and AdamW then run identically everywhere.

With `parallel: fsdp` the policy is sharded with FSDP2 (`fully_shard`, one unit per decoder layer plus the
root) instead: each rank holds 1/N of the parameters, gradients and AdamW state, and gathers a layer's
parameters only around its forward and backward. Those gathers are collectives, so every rank must run the
same number of forward passes: ranks with fewer micro-batches than the busiest one run masked padding ones.
What rank 0 alone did with the whole model under DDP (copy the weights to the engine, write a checkpoint,
score the sync's probe text) needs every rank under FSDP; rank 0 broadcasts each such request like a step.

Backends: `gloo` on CPU (tested here with 2 processes), `nccl` on GPUs (each rank on `cuda:LOCAL_RANK`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, cast

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


def from_env(timeout_s: float = 86400.0) -> World | None:
    """The process group torchrun describes (`WORLD_SIZE` > 1), joined; None for a single process.

    `timeout_s` bounds every collective, and ranks but 0 wait in one (`broadcast`) while rank 0 waits for
    a batch of rollouts: torch's defaults (30 min for gloo, 10 min for NCCL, whose watchdog then kills
    the process) are shorter than an agentic batch can take."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return None
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return World(rank, size, local)


def leave(clean: bool = True) -> None:
    """Leave the process group, on every rank, before the process exits: all ranks meet first (when this
    rank ends `clean`ly: after a failure its peers may never come), then each destroys its group.

    Without the destroy, Gloo's worker threads still hold work (and its tensors) when the interpreter is
    torn down, and a rank may abort at exit with "terminate called without an active exception" (the
    teardown problem pytorch/pytorch#179291 describes). Without the meeting, a rank that is done destroys
    its connections while its peer still finishes its last collective, which aborted a rank the same way
    in about 1 run in 15 of tests/test_train_distributed.py on two CPU cores."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def end_process(code: int = 0) -> NoReturn:
    """End a torchrun rank's process after `leave`: the exit handlers run, logs and stdio are flushed, and
    the process exits without finalizing the interpreter.

    Why: a Gloo worker thread drops the collective it ran only *after* the caller was told it finished. When
    that work held a tensor made in Python (`broadcast_object_list`'s), dropping it takes the GIL, and a
    thread that takes the GIL while the interpreter finalizes is ended by `pthread_exit`, whose unwinding
    through Gloo's frames is `std::terminate`: "terminate called without an active exception", SIGABRT, a
    rank reported failed after its work was done (core dump: `ProcessGroupGloo::runLoop` ->
    `~AsyncBroadcastWork` -> `decref_pyobject` -> `take_gil` -> `PyThread_exit_thread`; about 1 run in 25
    of tests/test_train_distributed.py with other work on the two cores). `destroy_process_group` would
    join those threads, but a `DistributedDataParallel` once built keeps the group alive (torch 2.13: its
    worker threads outlive both the destroy and the module), so skipping finalization is what ends the race."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code)


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


def max_all(value: int, device: torch.device) -> int:
    """The largest `value` over the ranks."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model: the classes it names in `_no_split_modules` (e.g.
    Qwen3DecoderLayer), which transformers itself never splits across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def fully_shard_model(model: torch.nn.Module, param_dtype: torch.dtype | None) -> None:
    """FSDP2 in place: each decoder layer its own unit, then the root (embeddings, final norm, head).
    `param_dtype` (bf16): parameters are gathered and computed in it, gradients reduced in float32, and the
    sharded master weights and optimizer state stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls it (it gathers); rank 0 gets the whole model's tensors on the CPU, the others {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)


def tied_duplicates(model: torch.nn.Module) -> list[str]:
    """The names of parameters that another, earlier name already holds (tied weights)."""
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append(name)
        seen.add(id(p))
    return out


def optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, sharded: bool
) -> dict[str, Any]:
    """The optimizer state keyed by parameter name (the same file whether the model was sharded or not, so a
    checkpoint resumes under either). `sharded` (FSDP): every rank calls it, rank 0 gets the whole state
    gathered to the CPU, the others {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=sharded, cpu_offload=sharded)
    return dict(get_optimizer_state_dict(model, optimizer, options=options))


def load_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], *, sharded: bool
) -> None:
    """Load what `optimizer_state` gave; `sharded`: every rank calls it with the whole state and keeps its
    shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=sharded))
