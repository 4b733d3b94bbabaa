"""Held-out evaluation during training: a task file run through the same stack every N steps.

The training reward says how the policy does on the tasks it is trained on, with the exploration of its
sampling temperature and the staleness of asynchronous groups; whether it generalizes needs tasks it never
trains on, sampled by exactly one policy version. `Evaluator.run` submits each held-out task (with `samples`
samples) right after a weight sync, while no other sync can happen, through the loop's own rollout server and
node, and waits for every session. Training groups keep running beside it.

Accuracy is the share of evaluated samples that passed (the evaluation's `passed`, else reward >=
`pass_threshold`); sessions without a reward (masked: infrastructure failures) are counted apart and left
out. Its 95 % interval resamples tasks, not samples: a task's samples move together, and resampling them as
if independent makes the interval too narrow.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from polar.client import RolloutClient, RolloutError
from polar.rollout.protocol import SessionResult
from polar.task import Task
from polar.train.export import trajectory_of


@dataclass(frozen=True, slots=True)
class EvalPlan:
    tasks: tuple[Task, ...]
    every: int  # evaluate after every `every`-th step (and after the last)
    samples: int | None = None  # per task; None: each task's num_samples
    before_training: bool = True  # evaluate the starting policy too (step 0)
    pass_threshold: float = 1.0


@dataclass(frozen=True, slots=True)
class EvalResult:
    step: int
    policy_version: int
    accuracy: float  # nan when no sample was scored
    low: float  # 95 % bootstrap interval over tasks
    high: float
    reward_mean: float
    samples: int  # scored samples
    errors: int  # sessions without a reward (masked), left out
    seconds: float
    by_task: dict[str, list[float]] = field(default_factory=dict)  # each scored sample: 1 passed, 0 not

    def metrics(self) -> dict[str, float]:
        """The keys a metrics line carries (polar.train.metrics.METRICS)."""
        return {
            "eval_accuracy": self.accuracy,
            "eval_accuracy_low": self.low,
            "eval_accuracy_high": self.high,
            "eval_reward_mean": self.reward_mean,
            "eval_samples": float(self.samples),
            "eval_errors": float(self.errors),
            "eval_s": self.seconds,
        }

    def line(self) -> dict[str, Any]:
        """One line of `OUT/eval.jsonl`."""
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            **self.metrics(),
            "by_task": self.by_task,
        }


def interval(by_task: dict[str, list[float]], seed: int = 0, n: int = 2000) -> tuple[float, float, float]:
    """Accuracy and its 95 % percentile bootstrap interval, resampling whole tasks."""
    groups = [v for _, v in sorted(by_task.items()) if v]
    if not groups:
        return float("nan"), float("nan"), float("nan")
    flat = [x for g in groups for x in g]
    rng = random.Random(seed)
    stats = []
    for _ in range(n):
        pick = [groups[rng.randrange(len(groups))] for _ in groups]
        stats.append(sum(sum(g) for g in pick) / sum(len(g) for g in pick))
    stats.sort()
    return sum(flat) / len(flat), stats[int(0.025 * n)], stats[int(0.975 * n) - 1]


def score(
    results: Sequence[SessionResult], source: dict[str, str], pass_threshold: float
) -> tuple[dict[str, list[float]], list[float], int]:
    """(passed per source task, the rewards, sessions without one)."""
    by_task: dict[str, list[float]] = {}
    rewards: list[float] = []
    errors = 0
    for r in results:
        reward = _reward(r)
        if reward is None:
            errors += 1
            continue
        rewards.append(reward)
        evaluation = (r.trajectory or {}).get("metadata", {}).get("evaluation")
        passed = evaluation.get("passed") if isinstance(evaluation, dict) else None
        if not isinstance(passed, bool):
            passed = reward >= pass_threshold
        by_task.setdefault(source.get(r.task_id, r.task_id), []).append(1.0 if passed else 0.0)
    return by_task, rewards, errors


def _reward(r: SessionResult) -> float | None:
    """The session's reward, else the mean of its traces' own (a session scored per trace); None: masked."""
    if r.reward is not None:
        return r.reward
    t = trajectory_of(r)
    if t is None or not t.traces or t.metadata.get("masked"):
        return None
    rewards = [tr.reward for tr in t.traces]
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in rewards):
        return None
    return sum(float(x) for x in rewards if x is not None) / len(rewards)


class Evaluator:
    def __init__(self, plan: EvalPlan, client: RolloutClient, run_id: str) -> None:
        self.plan = plan
        self.client = client
        self.run_id = run_id

    def due(self, step: int, last: int) -> bool:
        return (step == 0 and self.plan.before_training) or (
            step > 0 and (step % self.plan.every == 0 or step == last)
        )

    def _task(self, task: Task, step: int, version: int) -> Task:
        metadata = {
            **task.metadata,
            "source_task_id": task.task_id,
            "policy_version": version,
            "run_id": self.run_id,
            "eval": True,
            "eval_step": step,
        }
        update: dict[str, Any] = {
            "task_id": f"{task.task_id}-{self.run_id}-eval{step:05d}",
            "metadata": metadata,
        }
        if self.plan.samples is not None:
            update["num_samples"] = self.plan.samples
        return task.model_copy(update=update)

    async def run(self, step: int, version: int) -> EvalResult:
        """Every held-out task's sessions, sampled by `version`; cancelled ones are cancelled on the server."""
        started = time.perf_counter()
        tasks = [self._task(t, step, version) for t in self.plan.tasks]
        source = {t.task_id: t.metadata["source_task_id"] for t in tasks}
        ids = await self.client.submit(tasks)
        try:
            results = [r async for r in self.client.results(ids)]
        except BaseException:
            for task_id in ids:
                with contextlib.suppress(RolloutError, asyncio.CancelledError):
                    await self.client.cancel(task_id)
            raise
        by_task, rewards, errors = score(results, source, self.plan.pass_threshold)
        accuracy, low, high = interval(by_task)
        return EvalResult(
            step=step,
            policy_version=version,
            accuracy=accuracy,
            low=low,
            high=high,
            reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
            samples=len(rewards),
            errors=errors,
            seconds=time.perf_counter() - started,
            by_task=by_task,
        )
