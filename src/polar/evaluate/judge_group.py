"""`judge_group`: a task's sessions scored against each other by a frozen judge (relative, RULER-style).

    num_samples: 8                # the group: every session of the task
    evaluator:
      strategy: judge_group
      config:
        rubric: "The summary is faithful to the paper and says what is new."
        backend: {url: "http://judge:8000", kind: vllm, model: Qwen/Qwen3-8B}
        repeats: 16               # orderings asked; a multiple of 2 x num_samples balances positions

Nothing per session can see the other sessions (they end at different times, on different nodes), so the
reward comes in two halves:

- On the node, per session (this evaluator): the outcome is rendered while the runtime is still alive (the
  parts `judge` reads: `judge.outcome_parts`) and carried in the result with the reward pending; the node
  masks that trajectory (`reward_pending`), so nothing can train on it before its group is judged.
- On the server, once every session of the task has ended (`polar.rollout.server.grouping`): one node
  judges the COMPLETED outcomes together (`group_judging.judge_group`, `POST /node/judge_group`), each
  session's reward becomes its mean score / scale (`settle`), and the results are released; a group whose
  judging fails is released masked with the reason (fail-closed).

As one of `evaluators`, its reward is combined with the others' when the group is judged (`combine.settle`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polar.evaluate.base import GROUP_PENDING, EvalContext, EvalResult
from polar.evaluate.combine import settle as settle_combined
from polar.evaluate.group_judging import MAX_GROUP, GroupJudgeConfig
from polar.evaluate.judge import outcome_parts
from polar.evaluate.outcome import render
from polar.evaluate.support import parse_config
from polar.task import EvaluatorConfig, Task

NAME = "judge_group"


class GroupJudge:
    name = NAME
    needs_fresh_runtime = False
    calls_models = True  # the group is judged from a node: the agent may not share the host's network

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = parse_config(self.name, GroupJudgeConfig, config)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        parts = await outcome_parts(self.config, ctx)
        return EvalResult(
            reward=None,
            details={GROUP_PENDING: {"outcome": render(parts)}, "outcome": [p.summary() for p in parts]},
        )


def group_evaluator(task: Task) -> tuple[str | None, EvaluatorConfig] | None:
    """The task's `judge_group` evaluator: (its name among `evaluators`, or None for `evaluator`; its
    config), or None when the task's rewards are not relative."""
    if task.evaluators:
        for name, ev in task.evaluators.items():
            if ev.strategy == NAME:
                return name, ev
        return None
    return (None, task.evaluator) if task.evaluator.strategy == NAME else None


def group_problem(task: Task) -> tuple[str, str] | None:
    """(field, message) when the task cannot be judged as a group: more sessions than one call shows, or
    two group judges (each would need the other's reward first)."""
    named = [n for n, ev in task.evaluators.items() if ev.strategy == NAME]
    if len(named) > 1:
        return f"evaluators.{named[1]}.strategy", f"one judge_group per task ({named[0]!r} is one already)"
    if group_evaluator(task) is not None and task.num_samples > MAX_GROUP:
        return (
            "num_samples",
            f"judge_group shows the judge every session of the task in one call, at most {MAX_GROUP}; "
            f"this task has {task.num_samples}",
        )
    return None


def pending(details: Mapping[str, Any]) -> str | None:
    """The outcome text a pending evaluation carries, or None when its reward is not pending."""
    entry = details.get(GROUP_PENDING)
    if isinstance(entry, dict) and isinstance(entry.get("outcome"), str):
        return str(entry["outcome"])
    return None


def settle(details: Mapping[str, Any], reward: float, group: Mapping[str, Any], n_traces: int) -> EvalResult:
    """A pending evaluation once its group is judged: `reward` (mean score / scale) alone, or combined with
    the other evaluators'; `group` (this session's score, the orderings, the judge sessions) replaces the
    outcome text in the details."""
    entry = details[GROUP_PENDING]
    if entry.get("part") is None:
        shown = {k: v for k, v in details.items() if k != GROUP_PENDING}
        return EvalResult(reward=reward, details={**shown, "group": dict(group)})
    result = settle_combined(dict(details), reward, n_traces)
    part = result.details["parts"][entry["part"]]
    part["details"] = {**part.get("details", {}), "group": dict(group)}
    return result
