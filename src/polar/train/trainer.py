"""The reference trainer: one policy, AdamW, one optimizer step per batch of task groups.

    trainer = Trainer.load(TrainerConfig(model=None))          # None: the engine's offline tiny model
    samples, stats = build_samples(trajectories, "rloo")        # one Sample per trainable trace
    result = trainer.step(samples)                              # packed micro-batches, accumulated grads
    trainer.save(out / "checkpoints" / f"step-{trainer.step_count}")

A step packs the traces into micro-batches of at most `micro_batch_tokens` tokens (at least `grad_accum` of
them), runs each forward under bf16 autocast where the device has it, and backpropagates `policy_loss` with
a batch-wide denominator, so the accumulated gradient is the gradient of the whole batch's loss however it
was split. The old policy is the current one (one optimizer step per batch: `old_logprobs = logprobs.detach()`),
so the PPO ratio starts at 1 and truncated importance sampling corrects for the sampler's mismatch.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from polar.train import distributed, memory
from polar.train.advantages import Estimator, GroupStats, trajectory_advantages
from polar.train.lora import LoraSpec, apply_lora, is_lora, load_adapter, merged_state_dict, save_adapter
from polar.train.loss import LossConfig, LossMetrics, policy_loss
from polar.train.packing import pack, response_logprobs
from polar.train.schedule import LRSchedule
from polar.trajectory.models import Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class OptimizerConfig:
    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    schedule: LRSchedule = field(default_factory=LRSchedule)  # the rate of each step: lr x its factor


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    model: str | None = None  # HF id or folder; None: the engine's offline tiny model
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_tokens: int = 4096
    grad_accum: int = 1
    gradient_checkpointing: bool = False
    dtype: str = "auto"  # auto | float32 | bfloat16 (the autocast dtype; parameters stay float32)
    device: str = "auto"
    parallel: str = "ddp"  # ddp | fsdp, under torchrun (polar.train.distributed)
    temperature: float = 1.0  # sampling temperature of the behaviour logprobs
    seed: int = 0
    lora: LoraSpec | None = None  # None: every weight trains; else adapters only (polar.train.lora)


@dataclass(frozen=True, slots=True)
class Sample:
    """One trainable trace: its tokens, the behaviour logprobs, and its trajectory's advantage and weight."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    mask: Sequence[int]
    behaviour_logprobs: Sequence[float]
    advantage: float
    weight: float

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float
    grad_norm: float
    traces: int
    micro_batches: int
    tokens: int  # prompt + response tokens through the model
    metrics: LossMetrics
    logprob_diff: float  # mean |trainer - behaviour| logprob over trainable tokens, before the step
    seconds: float
    lr: float = 0.0  # the learning rate the step took (optimizer.lr x the schedule's factor)


def build_samples(
    trajectories: Sequence[Trajectory], estimator: Estimator = "rloo", *, pass_threshold: float = 1.0
) -> tuple[list[Sample], GroupStats, int]:
    """Samples of every trace that can be trained on, the group statistics, and how many traces could
    not be (no behaviour logprobs, no prompt): those are skipped, never guessed."""
    per_trace, stats = trajectory_advantages(trajectories, estimator, pass_threshold=pass_threshold)
    samples: list[Sample] = []
    skipped = 0
    for a in per_trace:
        tr = trajectories[a.trajectory].traces[a.trace]
        if a.weight <= 0.0 or tr.trainable_tokens == 0:
            continue
        if tr.response_logprobs is None or not tr.prompt_ids:
            skipped += 1
            continue
        samples.append(
            Sample(tr.prompt_ids, tr.response_ids, tr.loss_mask, tr.response_logprobs, a.advantage, a.weight)
        )
    return samples, stats, skipped


def micro_batches(lengths: Sequence[int], max_tokens: int, at_least: int = 1) -> list[list[int]]:
    """Consecutive index groups of about equal tokens: at most `max_tokens` each (a longer trace goes
    alone) and, when there are enough traces, at least `at_least` groups."""
    total = sum(lengths)
    target = min(max_tokens, max(1, math.ceil(total / max(at_least, 1))))
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and used + n > target:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA devices that support it; float32 (no autocast) elsewhere unless asked for. On a
    CPU, `bfloat16` is taken as asked: it is fast where the CPU has bf16 matrix units (AMX, AVX512-BF16:
    oneDNN uses them) and slow where it is emulated, so it is never chosen for a CPU by `auto`."""
    if name == "float32":
        return None
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if name == "bfloat16":
        if device.type == "cuda" and not cuda_bf16:
            raise ValueError(f"dtype bfloat16 needs a CUDA device with bf16 support, not {device}")
        return torch.bfloat16
    return torch.bfloat16 if cuda_bf16 else None


def model_source(model: str | None) -> str:
    """Where to load `model` from: the tiny default is built once into the engine's model cache."""
    if model is None:
        from polar.engine.tiny import default_model_dir

        return str(default_model_dir())
    return model


class Trainer:
    def __init__(
        self,
        model: Any,
        tokenizer: PreTrainedTokenizerBase,
        config: TrainerConfig,
        world: distributed.World | None = None,
    ) -> None:
        # `model`: a transformers model, peft-wrapped under LoRA. Any: transformers, peft and FSDP2 give it
        # attributes nn.Module does not declare (`config`, `set_requires_gradient_sync`).
        self.config = config
        self.world = world  # data-parallel under torchrun (polar.train.distributed); None: one process
        if config.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"parallel must be ddp or fsdp, not {config.parallel!r}")
        self.fsdp = world is not None and config.parallel == "fsdp"
        if self.fsdp and is_lora(model):
            raise ValueError("lora with parallel: fsdp is not supported; use parallel: ddp (the default)")
        self.device = _resolve_device(config.device)
        self.autocast = _autocast_dtype(config.dtype, self.device)
        self.model = model.to(self.device)
        if not is_lora(self.model):  # peft froze the base and left the adapters trainable
            self.model.requires_grad_(True)
        self.tokenizer = tokenizer
        if config.gradient_checkpointing:
            # transformers 5.x renamed gradient_checkpointing_enable (deprecated, removed in v6).
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.model.config.use_cache = False
        # Frozen initial policy for the k3 KL term; only kept when it is used.
        self.reference = (
            copy.deepcopy(self.model).eval().requires_grad_(False) if config.loss.kl_coef > 0 else None
        )
        # What forward passes go through: the policy itself (also once sharded in place by FSDP2), or its
        # DDP wrapper (which broadcasts rank 0's weights now, so every rank starts from the same ones).
        # FSDP2 does not broadcast: every rank loads the same checkpoint.
        self.forward_model: Any = self.model
        if self.fsdp:
            distributed.fully_shard_model(self.model, self.autocast)
            if self.reference is not None:
                distributed.fully_shard_model(self.reference, self.autocast)
        elif world is not None:
            ids = [self.device.index or 0] if self.device.type == "cuda" else None
            self.forward_model = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.step_count = 0
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    @classmethod
    def load(cls, config: TrainerConfig, world: distributed.World | None = None) -> Trainer:
        """Load the policy in float32 (master weights; autocast supplies bf16 compute) and its tokenizer."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.manual_seed(config.seed)
        source = model_source(config.model)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        if config.lora is not None:
            model = apply_lora(model, config.lora)
        return cls(model, tokenizer, config, world)

    # -- one optimizer step ---------------------------------------------------------------------------
    def _autocast(self) -> torch.autocast:
        if self.autocast is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _denominator(self, samples: Sequence[Sample]) -> float:
        if self.config.loss.aggregation == "token_mean":
            return float(max(sum(sum(s.mask) for s in samples), 1))
        return float(sum(s.weight for s in samples)) or 1.0

    def step(self, samples: Sequence[Sample]) -> StepResult:
        """Accumulate the batch's gradient over micro-batches, clip, and take one AdamW step. Data-parallel
        (rank 0): the batch is split over the ranks, which step on their shards together (`serve`)."""
        denominator = self._denominator(samples)
        if self.world is None:
            return self._step(samples, denominator)
        plan = distributed.shard([s.length for s in samples], self.world.size)
        message = ("step", [[samples[i] for i in idx] for idx in plan], denominator)
        distributed.broadcast(message)
        result: StepResult = self._handle(message)
        return result

    def serve(self) -> None:
        """A rank other than 0: take part in every step (and, under FSDP, every gather of the weights or
        forward pass) rank 0 starts, until it says stop (`close`)."""
        assert self.world is not None and not self.world.leader
        while True:
            message = distributed.broadcast()
            if message[0] == "stop":
                return
            self._handle(message)

    def _together(self, *message: Any) -> Any:
        """Rank 0: run `message` here, and under FSDP on every rank at once (it needs their shards)."""
        if self.fsdp:
            distributed.broadcast(message)
        return self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> Any:
        kind = message[0]
        if kind == "step":
            rank = self.world.rank if self.world is not None else 0
            return self._step(message[1][rank], message[2])
        if kind == "state":
            if self.fsdp:
                return distributed.full_state_dict(self.model)
            if is_lora(self.model):
                return merged_state_dict(self.model)
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        if kind == "optimizer":
            return distributed.optimizer_state(self.model, self.optimizer, sharded=self.fsdp)
        if kind == "logprobs":
            return self._logprobs(message[1], message[2])
        raise ValueError(f"unknown trainer request {kind!r}")

    def close(self) -> None:
        """Rank 0: let the other ranks' `serve` return."""
        if self.world is not None and self.world.leader:
            distributed.broadcast(("stop",))

    def _step(self, samples: Sequence[Sample], denominator: float) -> StepResult:
        started = time.perf_counter()
        cfg = self.config
        world = self.world.size if self.world is not None else 1
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        trainable = sum(sum(s.mask) for s in samples)
        traces = len(samples)
        dummy = not samples and self.world is not None
        if dummy:  # a rank with no trace still joins the gradient all-reduce: one masked token, no gradient
            samples = [Sample([self.pad_id], [self.pad_id], [0], [0.0], 0.0, 0.0)]
        groups = micro_batches([s.length for s in samples], cfg.micro_batch_tokens, cfg.grad_accum)
        real = 0 if dummy else len(groups)  # the groups after these are padding
        if self.fsdp:  # FSDP gathers parameters in every forward: all ranks run as many micro-batches
            pad = distributed.max_all(len(groups), self.device) - len(groups)
            if pad:
                samples = [*samples, Sample([self.pad_id], [self.pad_id], [0], [0.0], 0.0, 0.0)]
                groups += [[len(samples) - 1]] * pad

        total_loss = 0.0
        sums = {
            "clip_fraction": 0.0,
            "ratio_mean": 0.0,
            "tis_mean": 0.0,
            "tis_capped_fraction": 0.0,
            "kl": 0.0,
        }
        diff_sum = 0.0
        tokens = 0
        for n, idx in enumerate(groups):
            part = [samples[i] for i in idx]
            width = max(cfg.micro_batch_tokens, max(s.length for s in part))
            batch = pack([(s.prompt_ids, s.response_ids) for s in part], width, self.pad_id)
            mask = batch.flat([list(s.mask) for s in part], torch.float32).to(self.device)
            behaviour = batch.flat([list(s.behaviour_logprobs) for s in part], torch.float32).to(self.device)
            advantages = batch.flat([s.advantage for s in part], torch.float32).to(self.device)
            weights = torch.tensor([s.weight for s in part], dtype=torch.float32, device=self.device)
            # DDP all-reduces with the last micro-batch's backward only (the others accumulate locally);
            # FSDP reduce-scatters with it only.
            last = n == len(groups) - 1
            sync: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
            if self.fsdp:
                self.model.set_requires_gradient_sync(last)
            elif not last and self.world is not None:
                sync = self.forward_model.no_sync()
            with sync:
                with self._autocast():
                    logprobs = response_logprobs(self.forward_model, batch, cfg.temperature)
                    ref = None
                    if self.reference is not None:
                        with torch.no_grad():
                            ref = response_logprobs(self.reference, batch, cfg.temperature)
                loss, m = policy_loss(
                    logprobs,
                    behaviour,
                    advantages,
                    mask,
                    cfg.loss,
                    old_logprobs=logprobs.detach(),
                    ref_logprobs=ref,
                    seq_index=batch.seq_index.to(self.device),
                    seq_weights=weights,
                    denominator=denominator,
                )
                # DDP averages gradients over the ranks; scaled by their number, the average is the sum of
                # the shards' gradients, each already normalized by the whole batch's denominator.
                (loss * world).backward()
            total_loss += float(loss.detach())
            for k in sums:
                sums[k] += getattr(m, k) * m.tokens
            keep = mask.bool()
            diff_sum += float((logprobs.detach() - behaviour).abs()[keep].sum())
            tokens += sum(s.length for s in part) if n < real else 0

        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = 0.0
        if params:
            clip = cfg.optimizer.grad_clip
            norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"))
            full = getattr(norm, "full_tensor", None)  # FSDP: a replicated DTensor
            grad_norm = float(full() if full is not None else norm)
        lr = cfg.optimizer.lr * cfg.optimizer.schedule.factor(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.step_count += 1
        memory.trim()  # the step's logits and gradients, freed, go back to the system (polar.train.memory)
        micro = real
        if self.world is not None:  # the whole batch's figures, on every rank
            keys = list(sums)
            totals = distributed.sum_all(
                [total_loss, diff_sum, tokens, trainable, traces, micro, *(sums[k] for k in keys)],
                self.device,
            )
            total_loss, diff_sum, tokens_f, trainable_f, traces_f, micro_f = totals[:6]
            tokens, trainable, traces, micro = int(tokens_f), int(trainable_f), int(traces_f), int(micro_f)
            sums = dict(zip(keys, totals[6:], strict=True))
        n_tok = max(trainable, 1)
        metrics = LossMetrics(**{k: v / n_tok for k, v in sums.items()}, tokens=trainable)
        return StepResult(
            loss=total_loss,
            grad_norm=grad_norm,
            traces=traces,
            micro_batches=micro,
            tokens=tokens,
            metrics=metrics,
            logprob_diff=diff_sum / n_tok,
            seconds=time.perf_counter() - started,
            lr=lr,
        )

    # -- weights out ------------------------------------------------------------------------------------
    # Rank 0 calls these; under FSDP they gather from every rank (`_together`).
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole policy's tensors, detached (what an in-process engine copies from); under FSDP
        gathered to the CPU; LoRA adapters folded in."""
        state: dict[str, torch.Tensor] = self._together("state")
        return state

    def save_weights(self, folder: Path) -> Path:
        """The whole policy as a Hugging Face checkpoint (safetensors, config, tokenizer): what vLLM's
        `reload_weights` and `from_pretrained` read, whether the trainer is sharded or not (LoRA: the base
        with the adapters merged in)."""
        folder.mkdir(parents=True, exist_ok=True)
        if is_lora(self.model):
            self.model.get_base_model().save_pretrained(folder, state_dict=self.state_dict())
            self.tokenizer.save_pretrained(folder)
            memory.trim()
            return folder
        state = None
        if self.fsdp:
            # Gathered tensors share no storage, so transformers would keep a tied copy (lm_head.weight of
            # a model with tied embeddings): drop every name of a parameter but its first, as it does.
            state = self.state_dict()
            for name in distributed.tied_duplicates(self.model):
                state.pop(name, None)
        self.model.save_pretrained(folder, state_dict=state)
        self.tokenizer.save_pretrained(folder)
        memory.trim()  # the serialized copy of the weights
        return folder

    def save(self, folder: Path) -> Path:
        """`save_weights` plus `optimizer.pt` (unsharded, keyed by parameter name: resumable with or without
        FSDP) and `trainer_state.json`; a LoRA run also keeps its adapter (`adapter/`), which is what it
        resumes from."""
        self.save_weights(folder)
        if is_lora(self.model):
            save_adapter(self.model, folder)
        torch.save(self._together("optimizer"), folder / "optimizer.pt")
        state = {"step": self.step_count, "policy_version": self.step_count, "model": self.config.model}
        (folder / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
        return folder

    def restore(self, folder: Path) -> None:
        """Optimizer state and step count from a folder `save` wrote (the weights load with the model; a
        LoRA run loads its base model and takes the adapter from here). Every rank calls it; under FSDP
        each keeps its shard of the saved state."""
        if is_lora(self.model):
            load_adapter(self.model, folder)
        state = torch.load(folder / "optimizer.pt", map_location="cpu" if self.fsdp else self.device)
        groups = state.get("param_groups") or [{"params": []}]
        if all(isinstance(p, int) for p in groups[0]["params"]) and groups[0]["params"]:
            # Written before optimizer.pt was keyed by name: torch's own format, by parameter index.
            if self.fsdp:
                raise ValueError(f"{folder}: this optimizer.pt resumes without parallel: fsdp only")
            self.optimizer.load_state_dict(state)
        else:
            distributed.load_optimizer_state(self.model, self.optimizer, state, sharded=self.fsdp)
        self.step_count = int(json.loads((folder / "trainer_state.json").read_text())["step"])

    def logprobs(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> list[float]:
        """Logprobs of `response_ids` after `prompt_ids` under the current policy, in eval mode (what the
        weight sync compares a server's with)."""
        out: list[float] = self._together("logprobs", list(prompt_ids), list(response_ids))
        return out

    def _logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        batch = pack([(prompt_ids, response_ids)], len(prompt_ids) + len(response_ids), self.pad_id)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return [float(x) for x in response_logprobs(self.model, batch, 1.0)]
        finally:
            self.model.train(was_training)
