"""Several evaluators, one reward: a task's `evaluators`, combined as its `reward` says.

    evaluators:
      tests: {strategy: command, config: {runner: pytest}}
      quality: {strategy: judge, config: {rubric: "...", backend: {...}}}
    reward: {combine: min, thresholds: {quality: 0.5}}      # tests pass AND the judge gives at least 0.5

The evaluators run one after another, in the order the task lists them, each with its own config and
timeout; the one that needs a fresh runtime gets it (at most one may: a second would apply the diff to a
runtime the first already changed). Each reward is thresholded (`thresholds`: 1 at or above, 0 below),
weighted (`weights`, default 1), then combined: `sum`, `min` or `product`. Per-trace rewards combine trace
by trace (an outcome reward stands for every trace).

Fail-closed like one evaluator: if any of them fails (raises, times out, gives no finite reward), the whole
evaluation fails and the node masks the session; if any finds the agent broke what it needs (`AgentFault`),
the session's reward is 0, whatever the others gave.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from polar.evaluate.base import GROUP_PENDING, AgentFault, EvalContext, EvalResult, Evaluator
from polar.evaluate.support import EvaluatorError

COMBINE: dict[str, Callable[[list[float]], float]] = {
    "sum": lambda values: float(sum(values)),
    "min": min,
    "product": lambda values: float(math.prod(values)),
}


@dataclass(frozen=True)
class Part:
    """One named evaluator of the combination, with what the task says about it."""

    name: str
    evaluator: Evaluator
    config: dict[str, Any]
    fresh: bool  # it gets the fresh runtime
    timeout_s: float
    weight: float = 1.0
    threshold: float | None = None


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class Combined:
    name = "combined"

    def __init__(self, parts: list[Part], combine: str) -> None:
        if combine not in COMBINE:
            raise ValueError(f"combine must be one of {', '.join(COMBINE)}, not {combine!r}")
        self.parts, self.combine = parts, combine
        self.needs_fresh_runtime = any(p.fresh for p in parts)

    async def _run(self, part: Part, ctx: EvalContext) -> EvalResult:
        sub = replace(ctx, config=part.config, fresh=ctx.fresh if part.fresh else None)
        try:
            async with asyncio.timeout(part.timeout_s):
                return await part.evaluator.evaluate(sub)
        except TimeoutError:
            raise EvaluatorError(f"evaluator {part.name!r} timed out after {part.timeout_s:g} s") from None
        except AgentFault as fault:
            raise AgentFault(f"evaluator {part.name!r}: {fault}") from fault
        except Exception as exc:
            raise EvaluatorError(f"evaluator {part.name!r}: {type(exc).__name__}: {exc}") from exc

    def _values(self, part: Part, result: EvalResult, n: int) -> list[float] | float:
        """The part's reward (a number, or one per trace), thresholded and weighted."""
        if result.trace_rewards is not None:
            raw: list[Any] | Any = result.trace_rewards
            if len(raw) != n or not all(_finite(r) for r in raw):
                raise EvaluatorError(f"evaluator {part.name!r} gave {len(raw)} trace rewards for {n} traces")
        elif _finite(result.reward):
            raw = result.reward
        else:
            raise EvaluatorError(f"evaluator {part.name!r} gave no finite reward: {result.reward!r}")

        def counted(r: float) -> float:
            if part.threshold is not None:
                r = 1.0 if r >= part.threshold else 0.0
            return part.weight * float(r)

        return [counted(r) for r in raw] if isinstance(raw, list) else counted(raw)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        n = len(ctx.trajectory.traces)
        report: dict[str, Any] = {}
        pending: dict[str, Any] | None = None
        for part in self.parts:
            result = await self._run(part, ctx)
            if GROUP_PENDING in result.details:  # judge_group: counted when the group is judged (`settle`)
                pending = {**result.details[GROUP_PENDING], "part": part.name}
                shown = {k: v for k, v in result.details.items() if k != GROUP_PENDING}
                report[part.name] = {"pending": True, **self._terms(part), "details": shown}
                continue
            value = self._values(part, result, n)
            passed = result.passed
            if part.threshold is not None and result.trace_rewards is None:
                passed = float(result.reward or 0.0) >= part.threshold  # a thresholded score is a verdict
            report[part.name] = {
                "reward": result.reward,
                **({"trace_rewards": result.trace_rewards} if result.trace_rewards is not None else {}),
                "counted": value,
                **self._terms(part),
                "passed": passed,
                "details": result.details,
            }
        if pending is not None:
            details = {"combine": self.combine, "parts": report, GROUP_PENDING: pending}
            return EvalResult(reward=None, details=details)
        return folded(self.combine, report, n)

    @staticmethod
    def _terms(part: Part) -> dict[str, Any]:
        return {
            "weight": part.weight,
            **({"threshold": part.threshold} if part.threshold is not None else {}),
        }


def folded(combine: str, report: dict[str, Any], n: int) -> EvalResult:
    """The parts' counted values (`report`, in the task's order) combined into one result."""
    values: list[list[float] | float] = [entry["counted"] for entry in report.values()]
    verdicts: list[bool | None] = [entry["passed"] for entry in report.values()]
    fold = COMBINE[combine]
    verdict = None if any(v is None for v in verdicts) else all(verdicts)
    details = {"combine": combine, "parts": report}
    scalars = [v for v in values if not isinstance(v, list)]
    if len(scalars) == len(values):
        return EvalResult(reward=fold(scalars), passed=verdict, details=details)
    columns = zip(*([v] * n if not isinstance(v, list) else v for v in values), strict=True)
    rewards = [fold(list(column)) for column in columns]
    return EvalResult(reward=None, trace_rewards=rewards, passed=verdict, details=details)


def settle(details: dict[str, Any], reward: float, n: int) -> EvalResult:
    """A combination whose `judge_group` part was pending (`evaluate`), once its group gave that part
    `reward`: counted as the others were (thresholded, weighted), then all combined again from the values
    the node kept in `details`."""
    name = details[GROUP_PENDING]["part"]
    report = {k: dict(v) for k, v in details["parts"].items()}
    entry = report[name]
    entry.pop("pending", None)
    threshold = entry.get("threshold")
    passed = None if threshold is None else reward >= threshold
    counted = float(reward) if threshold is None else (1.0 if passed else 0.0)
    report[name] = {**entry, "reward": reward, "counted": entry["weight"] * counted, "passed": passed}
    return folded(details["combine"], report, n)
