"""The async training loop: rollouts keep running while the policy trains.

    loop = TrainLoop(tasks, trainer, client, gate, sync, metrics, LoopConfig(steps=10, batch_groups=2))
    history = await loop.run()

Up to `max_in_flight` task groups (a task with `group_size` samples is one GRPO group) run on the rollout
service at once. A group is taken when all its sessions finished; a batch of `batch_groups` groups makes one
optimizer step, trained in a worker thread so the node and its gateway keep serving the next groups'
harness calls meanwhile. After each step the gateway is paused and drained, the weights are pushed to the
policy server, and the gateway resumes: every later call is answered, and recorded, by the new version.

Staleness: a group's version is the oldest policy version that produced any of its tokens (the gateway
records it per call; trace metadata `policy_version`), else the version it was submitted at. A group more
than `max_staleness` versions behind the trainer when it is taken is dropped and counted, never trained on.
With `pace` (the default) the loop also keeps groups from getting that old: it submits a group only while
the groups submitted, less those dropped or left out, stay within (steps taken + max_staleness + 1) x
batch_groups (AReaL's admission rule), so a group that comes back in submission order is trained within
`max_staleness` versions of the policy that sampled it, and rollouts wait for a sync instead of running
ahead to be thrown away. Groups that finish far out of order can still come back too old, and are dropped.

A fresh group then has its overlong answers masked or penalized and, with a `GroupFilter`, is left out when
it carries no gradient (polar.train.filters): the step takes the next finished group instead, up to the
filter's cap of groups per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar import interrupt
from polar.client import RolloutClient, RolloutError
from polar.rollout.protocol import SessionResult
from polar.rollout.rewards import has_tool_parse_error
from polar.task import Task
from polar.train.advantages import Estimator, GroupStats
from polar.train.evaluation import EvalPlan, Evaluator
from polar.train.export import trajectory_of
from polar.train.filters import FilterReason, GroupFilter, Overlong
from polar.train.metrics import Metrics, StepMetrics
from polar.train.sync import GatewayGate, PartialSyncError, WeightSync
from polar.train.trainer import StepResult, Trainer, TrainerConfig, build_samples
from polar.trajectory.models import Trajectory

if TYPE_CHECKING:
    from rich.console import Console

    from polar.train.config import TrainConfig

log = logging.getLogger("polar.train")


@dataclass(frozen=True, slots=True)
class LoopConfig:
    steps: int = 1
    batch_groups: int = 2
    group_size: int | None = None  # None: each task's num_samples
    max_staleness: int = 2
    max_in_flight: int = 4  # task groups submitted and not yet taken
    pace: bool = True  # submit only groups that will be trained within max_staleness versions
    estimator: Estimator = "rloo"
    pass_threshold: float = 1.0
    checkpoint_every: int | None = None  # the last step is always checkpointed
    out: Path | None = None  # checkpoints go under out/checkpoints/step-N (None: none written)
    shuffle: bool = True  # a new seeded order of the tasks each pass (False: the file's order)
    seed: int = 0
    filter: GroupFilter = field(default_factory=GroupFilter)  # dynamic sampling: none by default
    overlong: Overlong = field(default_factory=Overlong)  # answers cut by the token limit: kept by default
    eval: EvalPlan | None = None  # held-out evaluation every N steps


@dataclass(frozen=True, slots=True)
class Group:
    """The finished sessions of one submitted task group."""

    task_id: str
    results: tuple[SessionResult, ...]
    submitted_version: int

    def trajectories(self) -> list[Trajectory]:
        """Each session's trajectory with its reward; sessions without a reward are masked (not the
        policy's doing: the fail-closed rules give the policy's own failures a reward of 0)."""
        out: list[Trajectory] = []
        for r in self.results:
            t = trajectory_of(r)
            if t is None:
                continue
            meta = {**t.metadata, "group_id": self.task_id}
            if r.reward is not None:
                meta["reward"] = r.reward
            elif not all(isinstance(tr.reward, int | float) for tr in t.traces) or not t.traces:
                meta["masked"] = True
            out.append(t.model_copy(update={"metadata": meta}))
        return out

    @property
    def sampled_version(self) -> int:
        """The oldest policy version behind any token of the group (else the submission version)."""
        versions = [
            v
            for r in self.results
            if r.trajectory is not None
            for tr in r.trajectory.get("traces", [])
            if isinstance(v := tr.get("metadata", {}).get("policy_version"), int)
        ]
        return min(versions) if versions else self.submitted_version


@dataclass(frozen=True, slots=True)
class Shaped:
    """A fresh group as a step sees it: its trajectories after overlong shaping."""

    group: Group
    trajectories: list[Trajectory]
    overlong: int  # trajectories masked or penalized for length


@dataclass(frozen=True, slots=True)
class Batch:
    groups: list[Shaped]
    left_out: dict[FilterReason, int]  # groups the filter left out, by reason
    cap_reached: bool  # the filter's cap was reached and left-out groups filled the batch


def task_order(n: int, shuffle: bool, seed: int) -> Iterator[int]:
    """Task indices forever, pass after pass; each pass a new permutation when `shuffle`. Task files are
    often sorted (by name, by repository): in file order consecutive batches are alike, and the policy learns
    what they share. Measured on examples/learn_real (alphabetical words): 9 steps over words starting with
    "a" taught Gemma to answer "a" and to begin every capitalized word "AL" (held-out 0.105 -> 0.023)."""
    rng = random.Random(seed)
    while True:
        order = list(range(n))
        if shuffle:
            rng.shuffle(order)
        yield from order


def staleness(group: Group, version: int) -> int:
    return max(0, version - group.sampled_version)


class TrainLoop:
    def __init__(
        self,
        tasks: Sequence[Task],
        trainer: Trainer,
        client: RolloutClient,
        gate: GatewayGate,
        sync: WeightSync,
        metrics: Metrics,
        config: LoopConfig,
    ) -> None:
        if not tasks:
            raise ValueError("the loop needs at least one task")
        cap = config.filter.max_groups
        if cap is not None and cap < config.batch_groups:
            raise ValueError(f"the filter's cap ({cap} groups per step) is less than batch_groups")
        self.tasks = list(tasks)
        self.trainer = trainer
        self.client = client
        self.gate = gate
        self.sync = sync
        self.metrics = metrics
        self.config = config
        self.version = trainer.step_count
        self.dropped = 0  # stale groups dropped since the last step
        self.dropped_total = 0
        self._start_version = self.version
        self._submitted = 0  # groups submitted by this loop
        self._wasted = 0  # of those, taken and not trained on (dropped stale, left out by the filter)
        self._ready: asyncio.Queue[Group | BaseException] = asyncio.Queue()
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._round = itertools.count()
        # Task ids are unique on the rollout server for good (its state outlives a run, e.g. a resume into
        # the same out directory), so each loop names its groups with its own run id.
        self.run_id = uuid.uuid4().hex[:8]
        self.evaluator = Evaluator(config.eval, client, self.run_id) if config.eval is not None else None
        # Seeded by the step too: a resumed run draws a new order instead of replaying the first batches.
        self._order = task_order(len(self.tasks), config.shuffle, config.seed * 1_000_003 + self.version)

    # -- rollouts ---------------------------------------------------------------------------------------
    def _group_task(self, task: Task, n: int) -> Task:
        """A fresh, uniquely named copy of `task`: each submission is its own group and task id."""
        task_id = f"{task.task_id}-{self.run_id}-r{n:05d}"
        metadata = {
            **task.metadata,
            "group_id": task_id,
            "source_task_id": task.task_id,
            "policy_version": self.version,
            "rollout_round": n,
            "run_id": self.run_id,
        }
        update: dict[str, Any] = {"task_id": task_id, "metadata": metadata}
        if self.config.group_size is not None:
            update["num_samples"] = self.config.group_size
        return task.model_copy(update=update)

    async def _collect(self, task_id: str, version: int) -> None:
        try:
            results = tuple([r async for r in self.client.results(task_id)])
            await self._ready.put(Group(task_id, results, version))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaces in run(): a dead server must stop training loudly
            await self._ready.put(exc)

    def _admissible(self) -> bool:
        """Whether one more group may start now (`pace`): it would be trained within `max_staleness`
        versions if the groups ahead of it are taken first. Always true while the current step lacks
        groups and none is running, so the loop never waits on nothing."""
        if not self.config.pace:
            return True
        steps = self.version - self._start_version
        allowed = (steps + self.config.max_staleness + 1) * self.config.batch_groups
        return self._submitted - self._wasted < allowed

    async def _top_up(self) -> None:
        while len(self._in_flight) < self.config.max_in_flight and self._admissible():
            task = self._group_task(self.tasks[next(self._order)], next(self._round))
            await self.client.submit(task)
            self._submitted += 1
            self._in_flight[task.task_id] = asyncio.create_task(self._collect(task.task_id, self.version))

    async def _next_group(self) -> Group:
        await self._top_up()
        item = await self._ready.get()
        if isinstance(item, BaseException):
            raise item
        self._in_flight.pop(item.task_id, None)
        return item

    def admit(self, group: Group) -> bool:
        """Whether `group` is fresh enough to train on now; a stale one is counted as dropped."""
        if staleness(group, self.version) > self.config.max_staleness:
            self.dropped += 1
            self.dropped_total += 1
            self._wasted += 1
            return False
        return True

    async def _batch(self) -> Batch:
        """Fresh groups until `batch_groups` of them carry a gradient, or until the filter's cap of groups
        taken is reached: then the groups left out last fill the batch (fresh, if without signal)."""
        cfg = self.config
        kept: list[Shaped] = []
        left_out: list[tuple[Shaped, FilterReason]] = []
        cap_reached = False
        while len(kept) < cfg.batch_groups:
            group = await self._next_group()
            if not self.admit(group):
                continue
            trajectories, overlong = cfg.overlong.apply(group.trajectories())
            shaped = Shaped(group, trajectories, overlong)
            reason = cfg.filter.reason(trajectories, cfg.estimator) if cfg.filter.active else None
            if reason is None:
                kept.append(shaped)
                continue
            left_out.append((shaped, reason))
            self._wasted += 1  # at once: pacing must start the group that replaces it (else: no group runs)
            cap = cfg.filter.max_groups
            if cap is not None and len(kept) + len(left_out) >= cap:
                need = cfg.batch_groups - len(kept)
                kept += [s for s, _ in left_out[-need:]]
                del left_out[-need:]
                self._wasted -= need  # trained on after all
                cap_reached = True
        counts: dict[FilterReason, int] = {"zero_variance": 0, "all_masked": 0}
        for _, reason in left_out:
            counts[reason] += 1
        if cap_reached:
            log.warning(
                "step %d: %d groups taken, %d with a learning signal: filled the batch with groups the "
                "filter left out (filter.max_groups_per_step)",
                self.trainer.step_count + 1,
                cfg.filter.max_groups,
                sum(1 for s in kept if cfg.filter.reason(s.trajectories, cfg.estimator) is None),
            )
        return Batch(kept, counts, cap_reached)

    # -- steps ------------------------------------------------------------------------------------------
    def _train(self, batch: list[Shaped]) -> tuple[StepResult, GroupStats, int]:
        trajectories = [t for s in batch for t in s.trajectories]
        samples, stats, skipped = build_samples(
            trajectories, self.config.estimator, pass_threshold=self.config.pass_threshold
        )
        return self.trainer.step(samples), stats, skipped

    async def _sync(self) -> tuple[float, bool]:
        """Push the trainer's weights between a gateway pause and resume: (seconds, whether every call in
        flight finished before the drain timeout)."""
        started = time.perf_counter()
        async with self.gate.paused() as pause:
            try:
                await self.sync.push(self.trainer, self.trainer.step_count)
            except PartialSyncError as exc:
                if not exc.synced:
                    raise
                # Before the gate opens: no call reaches a server left with old or half-loaded weights.
                log.error("%s; taking them out of the gateway's rotation", exc)
                for url in exc.failed:
                    await self.gate.set_backend(url, enabled=False)
            pause.policy_version = self.trainer.step_count
        self.version = self.trainer.step_count
        return time.perf_counter() - started, pause.drained

    async def step(self) -> StepMetrics:
        """Wait for a batch of fresh groups, train on it, sync the weights, record the metrics."""
        waited = time.perf_counter()
        taken = await self._batch()
        batch = taken.groups
        wait_s = time.perf_counter() - waited
        lags = [staleness(s.group, self.version) for s in batch]
        result, stats, skipped = await asyncio.to_thread(self._train, batch)
        sync_s, drained = await self._sync()
        step = self.trainer.step_count
        cfg = self.config
        if cfg.out is not None and (
            step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
        ):
            await asyncio.to_thread(self.trainer.save, cfg.out / "checkpoints" / f"step-{step}")
        held_out = await self._evaluate(step)
        m = result.metrics
        record = StepMetrics(
            step=step,
            policy_version=self.version,
            reward_mean=stats.mean_reward,
            reward_std=stats.reward_std,
            pass_rate=stats.pass_rate,
            groups=len(batch),
            samples=stats.samples,
            zero_variance_groups=stats.zero_variance_groups,
            dropped_stale_groups=self.dropped,
            staleness_mean=sum(lags) / len(lags),
            staleness_max=max(lags),
            traces=result.traces,
            tokens=result.tokens,
            trainable_tokens=m.tokens,
            loss=result.loss,
            grad_norm=result.grad_norm,
            clip_fraction=m.clip_fraction,
            kl=m.kl,
            tis_mean=m.tis_mean,
            logprob_diff=result.logprob_diff,
            rollout_wait_s=wait_s,
            train_s=result.seconds,
            sync_s=sync_s,
            extra={
                "masked": float(stats.masked),
                "untrainable_traces": float(skipped),
                "lr": result.lr,
                "tool_call_parse_errors": float(
                    sum(has_tool_parse_error(t) for s in batch for tr in s.trajectories for t in tr.traces)
                ),
                "filtered_zero_variance_groups": float(taken.left_out["zero_variance"]),
                "filtered_masked_groups": float(taken.left_out["all_masked"]),
                "filter_cap_reached": float(taken.cap_reached),
                "overlong_samples": float(sum(s.overlong for s in batch)),
                "sync_drained": float(drained),  # 0: the drain timed out (the policy server drains itself)
                **held_out,
            },
        )
        self.dropped = 0
        self.metrics.log(record)
        return record

    async def _evaluate(self, step: int) -> dict[str, float]:
        """The held-out evaluation due after `step` (0: before training), as metrics keys; {} if none."""
        if self.evaluator is None or not self.evaluator.due(step, self.config.steps):
            return {}
        result = await self.evaluator.run(step, self.version)
        self.metrics.evaluated(result.line())
        return result.metrics()

    async def run(self) -> list[StepMetrics]:
        """Train until the trainer has taken `steps` steps (a resumed trainer first pushes its weights and
        version to the policy server); groups still running at the end are cancelled on the server."""
        try:
            # Resumed: the policy server must serve the trainer's version; a runtime-loaded LoRA adapter
            # must exist before the first rollout asks for it by name.
            if self.trainer.step_count > 0 or self.sync.push_before_rollouts:
                await self._sync()
            if self.trainer.step_count == 0:  # a new run: the starting policy's baseline
                await self._evaluate(0)
            while self.trainer.step_count < self.config.steps:
                await self.step()
        finally:
            await self.close()
        return self.metrics.history

    async def close(self) -> None:
        """Cancel every group submitted and not taken (on the server too) and forget finished ones."""
        for task_id, collector in list(self._in_flight.items()):
            collector.cancel()
            with contextlib.suppress(asyncio.CancelledError, RolloutError):
                await collector
            with contextlib.suppress(RolloutError):
                await self.client.cancel(task_id)
        self._in_flight.clear()
        while not self._ready.empty():  # finished but never taken: abandoned with the rest
            self._ready.get_nowait()


def train(
    config: TrainConfig,
    tasks: Sequence[Task],
    console: Console | None = None,
    upload_roots: Sequence[Path] = (),
) -> list[StepMetrics]:
    """Everything `polar train` runs, on this machine: the policy server (the embedded engine, or a vLLM
    server or servers at `config.backend`), the rollout server and a node, the trainer, and the loop.

    `console` gets the progress bar and one line per step (None: metrics go to the JSONL file only);
    `upload_roots` are the directories the tasks' uploads may read (`polar.train.config.upload_roots`).
    """
    from polar.stack import embedded_engine
    from polar.train import distributed, memory
    from polar.train.sync import EngineSync, VLLMSync

    memory.limit_arenas()  # before any thread allocates: steps from threads otherwise grow the heap (memory.py)
    # Under torchrun every rank trains on its shard of each batch; rank 0 alone runs the rest.
    world = distributed.from_env(config.dist_timeout_s)
    if world is not None and not world.leader:
        worker = Trainer.load(_trainer_config(config), world)
        if config.resume is not None:
            worker.restore(Path(config.resume))
        try:
            worker.serve()
        finally:
            distributed.leave(clean=sys.exc_info()[1] is None)
        return []

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    m = config.metrics
    metrics = Metrics.create(
        out,
        steps=config.steps,
        console=console,
        tensorboard=m.tensorboard,
        wandb=m.wandb,
        wandb_project=m.wandb_project,
        run_name=m.run_name,
        run_config=config.model_dump(mode="json"),
    )
    trainer: Trainer | None = None
    try:
        # Sinks first: a missing tensorboard/wandb fails before minutes of model loading.
        trainer = Trainer.load(_trainer_config(config), world)
        if config.resume is not None:
            trainer.restore(Path(config.resume))
            metrics.resumed_at(trainer.step_count)  # `steps` is the total: the bar starts where it left off
        run = _Run(
            config, tasks, trainer, metrics, console, tuple(upload_roots), _active_tasks(out / "server.db")
        )
        if config.backend == "embedded":
            device = None if config.device == "auto" else config.device
            with embedded_engine(config.resume or config.model, device=device) as (engine, server):
                return interrupt.run(run.rollouts((server.url,), engine.name, EngineSync(engine)))
        lora = config.lora
        adapter = lora.adapter_name if lora is not None and lora.sync == "adapter" else None
        sync = VLLMSync(
            config.backend,
            out / "sync",
            timeout_s=config.drain_timeout_s,
            verify=config.verify_weight_sync,
            adapter=adapter,
        )
        # With a runtime adapter, the rollouts ask vLLM for it by name: the base model is not the policy.
        urls = (config.backend,) if isinstance(config.backend, str) else tuple(config.backend)
        return interrupt.run(run.rollouts(urls, adapter or config.served_model, sync))
    finally:
        if trainer is not None:
            trainer.close()  # the other ranks' serve() returns, and they come to leave() too
        distributed.leave(clean=trainer is not None)
        metrics.close()


@dataclass(frozen=True)
class _Run:
    """What `train` has ready once the trainer is loaded; `rollouts` runs the loop against a policy server."""

    config: TrainConfig
    tasks: Sequence[Task]
    trainer: Trainer
    metrics: Metrics
    console: Console | None
    upload_roots: tuple[Path, ...]
    leftovers: list[str]  # task groups an earlier, killed run into `out` left open

    async def rollouts(self, urls: tuple[str, ...], model: str | None, sync: WeightSync) -> list[StepMetrics]:
        """The rollout server and a node over the policy at `urls` (serving `model`), and the loop."""
        from polar.dashboard import DashboardOptions
        from polar.stack import PolicyServer, local_stack

        config, out = self.config, Path(self.config.out)
        async with local_stack(
            out,
            PolicyServer(urls, "vllm", model, render=config.render),
            config.capacity,
            stop_reason="training ended",
            allow_callback=tuple(config.allow_callback),
            upload_roots=self.upload_roots,
            dashboard=DashboardOptions(train_dir=out),
        ) as stack:
            if self.console is not None:  # rollouts live, and this run's curves on the training page
                self.console.print(f"dashboard: {stack.dashboard_url}", soft_wrap=True, highlight=False)
            gate = GatewayGate(stack.control_url, control_token=stack.token, timeout_s=config.drain_timeout_s)
            try:
                async with RolloutClient(stack.server_url, token=stack.token) as client:
                    for task_id in self.leftovers:  # nobody takes them: closed, so the server stops waiting
                        with contextlib.suppress(RolloutError):
                            await client.cancel(task_id)
                    loop = TrainLoop(
                        self.tasks, self.trainer, client, gate, sync, self.metrics, _loop_config(config, out)
                    )
                    return await loop.run()
            finally:
                await gate.aclose()
                await sync.aclose()


def _trainer_config(config: TrainConfig) -> TrainerConfig:
    from polar.train.schedule import LRSchedule
    from polar.train.trainer import OptimizerConfig, TrainerConfig

    opt = config.optimizer
    return TrainerConfig(
        # A LoRA checkpoint's weights have its adapter merged in: a resumed LoRA run starts from the base
        # model again and takes the adapter from the checkpoint (Trainer.restore).
        model=config.model if config.lora is not None else (config.resume or config.model),
        loss=config.loss_config(),
        optimizer=OptimizerConfig(
            opt.lr,
            opt.weight_decay,
            opt.betas,
            opt.eps,
            opt.grad_clip,
            LRSchedule(opt.schedule, opt.warmup_steps, opt.min_lr_ratio, config.steps),
        ),
        micro_batch_tokens=config.micro_batch_tokens,
        grad_accum=config.grad_accum,
        gradient_checkpointing=config.gradient_checkpointing,
        dtype=config.dtype,
        device=config.device,
        parallel=config.parallel,
        temperature=config.temperature,
        seed=config.seed,
        lora=config.lora.spec() if config.lora is not None else None,
    )


def _loop_config(config: TrainConfig, out: Path) -> LoopConfig:
    evaluation = config.eval
    return LoopConfig(
        steps=config.steps,
        batch_groups=config.batch_groups,
        group_size=config.group_size,
        max_staleness=config.max_staleness,
        max_in_flight=config.in_flight,
        pace=config.pace,
        estimator=config.estimator,
        pass_threshold=config.pass_threshold,
        checkpoint_every=config.checkpoint_every,
        out=out,
        shuffle=config.shuffle,
        seed=config.seed,
        filter=config.group_filter(),
        overlong=config.overlong.spec(),
        eval=None
        if evaluation is None
        else EvalPlan(
            tuple(evaluation.loaded_tasks),
            evaluation.every,
            before_training=evaluation.before_training,
            pass_threshold=config.pass_threshold,
        ),
    )


def _active_tasks(db: Path) -> list[str]:
    """Task groups an earlier run into the same `out` left unfinished (it was killed before `close`)."""
    if not db.is_file():
        return []
    from polar.rollout.server.store import ServerStore

    store = ServerStore(db)
    try:
        return store.active_task_ids()
    finally:
        store.close()
