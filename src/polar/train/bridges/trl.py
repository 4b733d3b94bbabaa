"""TRL's `GRPOTrainer` trained on polar rollouts: a `rollout_func` that runs harness sessions.

    rollout = PolarRollout("http://127.0.0.1:8300", task=Task(task_id="t", instruction="", agent=...))
    trainer = GRPOTrainer(model, reward_funcs=[polar_reward], args=GRPOConfig(num_generations=4, ...),
                          train_dataset=Dataset.from_dict({"prompt": instructions}), rollout_func=rollout)

TRL 1.16 (`trl/trainer/grpo_trainer.py`, experimental `rollout_func`) calls `rollout_func(prompts, trainer)`
with this process's slice of the generation batch. Its `RepeatSampler` has already repeated each dataset
prompt `num_generations` times in a row, and TRL expects exactly one completion per entry, in order: the
rewards of entries k*G .. k*G+G-1 form one GRPO group. So every distinct prompt becomes ONE polar task
with `num_samples` = its count (one group on the rollout server too), submitted through
`polar.client.RolloutClient`, and sample i of the task answers the prompt's i-th entry.

From each session the main chain (`polar.train.export.main_trace`: the agent loop under prefix_merging)
becomes TRL's row, token for token as the inference server produced it; nothing is re-tokenized:
    prompt_ids      trace.prompt_ids
    completion_ids  trace.response_ids (sampled turns, and the tool results / template glue between them)
    env_mask        trace.loss_mask (TRL pops it as its tool mask: 0 is never trained)
    logprobs        trace.response_logprobs (the behaviour logprobs; TRL uses them for its vLLM importance
                    sampling correction, which it only enables with `use_vllm`)
    polar_reward    trace.reward, forwarded by TRL to reward functions as a keyword: `polar_reward` below.
A session without a usable trace (failed, masked, no logprobs) still owes TRL an entry: it gets an all-zero
`env_mask` and reward None, which TRL 1.16 treats as unscorable (NaN, advantage forced to 0), so it adds no
gradient. Other trainable traces of a session (subagents, compaction, side calls) cannot be handed to this
hook, whose unit is one completion per prompt; they are counted in `last_stats`, not silently dropped.

Several processes (`accelerate launch --num_processes N`): TRL calls `rollout_func` on every rank with that
rank's slice of the generation batch, and a prompt's `num_generations` entries may straddle ranks (TRL
regroups them when it gathers the rewards, in rank order). Rolling out per rank would split one GRPO group
into several polar tasks, sample them from N clients and sync the policy server's weights N times. So the
ranks gather their prompts on the main process, which runs the whole generation batch (one polar task per
distinct prompt, the weight sync once) and broadcasts the rows; each rank returns its own slice, in the
order TRL gave it. The other ranks wait in that broadcast for as long as the rollouts take: TRL's
`ddp_timeout` (default 1800 s) must exceed the longest rollout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import orjson

from polar.client import RolloutClient
from polar.extras import TRL, require
from polar.jsontypes import JSON
from polar.rollout.protocol import SessionResult
from polar.task import Task
from polar.train.export import main_trace, trajectory_of

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase
    from trl.trainer.grpo_trainer import GRPOTrainer

    from polar.engine.engine import Engine

TaskFactory = Callable[[JSON], Task]  # a TRL prompt (a string or a conversation) -> its Task
WeightSync: TypeAlias = "Callable[[nn.Module, int], None]"  # (the unwrapped model, TRL's global step)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Completion:
    """One entry of TRL's rollout batch, from one polar session."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    reward: float | None
    session_id: str | None
    status: str


def instruction_of(prompt: JSON) -> str:
    """The task instruction in a TRL prompt: the text itself, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        content = users[-1].get("content") if users else None
        if isinstance(content, str):
            return content
    raise ValueError(
        "TRL prompt: expected a string or a conversation whose last user message has string content, "
        f"got {type(prompt).__name__}"
    )


def completion_of(result: SessionResult | None, filler: int) -> tuple[Completion, int]:
    """TRL's entry for one session, and how many other trainable traces the session had.

    `filler` is the token of the masked one-token stand-in used only when the session left no trace at
    all (TRL cannot take an empty sequence); it is never trained."""
    status = result.status.value if result is not None else "MISSING"
    sid = result.session_id if result is not None else None
    trajectory = trajectory_of(result) if result is not None else None
    index = main_trace(trajectory) if trajectory is not None else None
    if trajectory is None or index is None:
        return Completion([filler], [filler], [0.0], [0], None, sid, status), 0
    trace = trajectory.traces[index]
    others = sum(1 for i, t in enumerate(trajectory.traces) if i != index and any(t.loss_mask))
    mask = list(trace.loss_mask)
    logprobs = trace.response_logprobs
    if logprobs is None:  # a build with train_without_logprobs: TRL would mis-weight such tokens
        mask, logprobs = [0] * len(mask), [0.0] * len(mask)
    usable = bool(trace.prompt_ids) and bool(trace.response_ids) and any(mask)
    if not usable:
        prompt = list(trace.prompt_ids) or [filler]
        response = list(trace.response_ids) or [filler]
        return Completion(prompt, response, [0.0] * len(response), [0] * len(response), None, sid, status), 0
    row = Completion(
        list(trace.prompt_ids), list(trace.response_ids), list(logprobs), mask, trace.reward, sid, status
    )
    return row, others


def polar_reward(
    completions: Sequence[Any], polar_reward: Sequence[float | None], **_: Any
) -> list[float | None]:
    """TRL reward function: the reward polar's evaluator gave each session (None: unscorable, no gradient)."""
    if len(polar_reward) != len(completions):
        raise ValueError(f"polar_reward has {len(polar_reward)} values for {len(completions)} completions")
    return list(polar_reward)


class PolarRollout:
    """A TRL `rollout_func` running each prompt's group as one polar task on the rollout server.

    `task` is a template Task (the prompt becomes its instruction) or a function building the Task for a
    prompt; either way polar sets its `task_id` (unique per call), `num_samples` and `metadata.trl_step`.
    `sync_weights(model, step)`, when given, is called before a rollout whenever TRL's global step moved
    since the last one, so sessions sample from the weights being trained (e.g. the embedded engine's
    `update_weights`; TRL's own vLLM sync covers only its own `use_vllm` client). Under several processes
    only the main process rolls out and syncs, and only its `last_results` / `last_stats` are filled (the
    whole generation batch's)."""

    def __init__(
        self,
        server_url: str,
        task: Task | TaskFactory,
        *,
        sync_weights: WeightSync | None = None,
        timeout_s: float = 3600.0,
        poll_wait_s: float = 5.0,
        token: str | None = None,
    ) -> None:
        require(TRL)  # at construction, not at TRL's first generation step
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.server_url = server_url
        self.token = token  # the rollout server's control token (None: POLAR_TOKEN or the token file)
        self.task = task
        self.sync_weights = sync_weights
        self.timeout_s = timeout_s
        self.poll_wait_s = poll_wait_s
        self.run_id = uuid.uuid4().hex[:8]
        self._calls = itertools.count()
        self._synced_step = 0
        self.last_results: list[SessionResult | None] = []
        self.last_stats: dict[str, int] = {}

    def _task_for(self, prompt: JSON, samples: int, step: int, call: int, group: int) -> Task:
        base = self.task(prompt) if callable(self.task) else self.task
        update: dict[str, Any] = {
            "task_id": f"trl-{self.run_id}-{call}-{group}",
            "num_samples": samples,
            "metadata": {**base.metadata, "trl_step": step, "trl_task_id": base.task_id},
        }
        if not callable(self.task):
            update["instruction"] = instruction_of(prompt)
        return Task.model_validate({**base.model_dump(), **update})

    def __call__(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is None or accelerator.num_processes == 1:
            return self._rollout(prompts, trainer)
        from accelerate.utils import broadcast_object_list, gather_object

        counts = gather_object([len(prompts)])
        everything = gather_object(list(prompts))
        box: list[Any] = [None]
        if accelerator.is_main_process:
            try:
                box[0] = self._rollout(everything, trainer)
            except Exception as exc:  # the other ranks wait in the broadcast: tell them, then raise here
                box[0] = f"{type(exc).__name__}: {exc}"
                broadcast_object_list(box, from_process=0)
                raise
        broadcast_object_list(box, from_process=0)
        if isinstance(box[0], str):
            raise RuntimeError(f"the main process's rollout failed: {box[0]}")
        start = sum(counts[: accelerator.process_index])
        return {k: v[start : start + len(prompts)] for k, v in box[0].items()}

    def _rollout(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        """The rows of `prompts` (the whole generation batch under several processes: main process only)."""
        step = int(trainer.state.global_step)
        if self.sync_weights is not None and step != self._synced_step:
            self.sync_weights(trainer.accelerator.unwrap_model(trainer.model), step)
            self._synced_step = step
        call = next(self._calls)
        # Identical prompts (TRL's repeats) form one group; the i-th occurrence gets sample i.
        groups: dict[bytes, list[int]] = {}
        for pos, prompt in enumerate(prompts):
            groups.setdefault(orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS), []).append(pos)
        tasks, slots = [], {}
        for g, positions in enumerate(groups.values()):
            task = self._task_for(prompts[positions[0]], len(positions), step, call, g)
            tasks.append(task)
            slots.update({(task.task_id, i): pos for i, pos in enumerate(positions)})
        found = _run_sync(self._collect(tasks))
        results: list[SessionResult | None] = [None] * len(prompts)
        for r in found:
            slot = slots.get((r.task_id, int(r.metadata.get("sample_index", -1))))
            if slot is not None:
                results[slot] = r
        self.last_results = results
        filler = _filler_token(trainer)
        rows, stats = [], {"sessions": len(prompts), "unusable": 0, "other_trainable_traces": 0}
        for result in results:
            row, others = completion_of(result, filler)
            rows.append(row)
            stats["unusable"] += not any(row.env_mask)
            stats["other_trainable_traces"] += others
            stats[f"status_{row.status.lower()}"] = stats.get(f"status_{row.status.lower()}", 0) + 1
        self.last_stats = stats
        return {
            "prompt_ids": [r.prompt_ids for r in rows],
            "completion_ids": [r.completion_ids for r in rows],
            "logprobs": [r.logprobs for r in rows],
            "env_mask": [r.env_mask for r in rows],
            "polar_reward": [r.reward for r in rows],
            "polar_session_id": [r.session_id for r in rows],
        }

    async def _collect(self, tasks: list[Task]) -> list[SessionResult]:
        out: list[SessionResult] = []
        async with RolloutClient(self.server_url, token=self.token, poll_wait_s=self.poll_wait_s) as client:
            try:
                async with asyncio.timeout(self.timeout_s):
                    async for result in client.run(tasks):
                        out.append(result)
            except TimeoutError:  # what finished is used; the rest is cancelled and reaches TRL masked
                for task_id in list(client.in_flight):
                    await client.cancel(task_id)
        return out


def _filler_token(trainer: GRPOTrainer) -> int:
    eos = getattr(trainer, "eos_token_ids", None)
    if eos:
        return int(eos[0])
    # a tokenizer, or a processor holding one
    tokenizer = cast(
        "PreTrainedTokenizerBase", getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    )
    return int(tokenizer.eos_token_id)


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from TRL's synchronous training loop, also when the calling thread
    already runs an event loop (a notebook): then on a helper thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def engine_weight_sync(engine: Engine) -> WeightSync:
    """`sync_weights` for polar's embedded engine (`polar.engine.Engine`): the trained state dict becomes
    policy version `step`, so the next sessions' records carry it."""

    def sync(model: nn.Module, step: int) -> None:
        engine.update_weights({k: v.detach() for k, v in model.state_dict().items()}, policy_version=step)

    return sync
