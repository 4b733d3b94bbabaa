"""Evaluators by name, `polar.evaluators` entry point, or import path, built and checked when a task is
submitted (not mid-run).

A custom evaluator is `"package.module:Name"` (where `polar.plugins` allows import paths: a local task file,
or a module the operator allowed) where `Name` is a class (or factory) called with the task's
`evaluator.config` (or with nothing, when it takes no argument and the config is empty); the object must
have `name`, `needs_fresh_runtime` and an async `evaluate(ctx)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

from polar import plugins
from polar.evaluate.base import Evaluator
from polar.evaluate.combine import Combined, Part
from polar.task import EvaluatorConfig, RewardConfig, Task

# A new evaluator is one file and its line here (its class's `name` is the key).
EVALUATORS = plugins.Registry(
    "evaluator",
    {
        "session_completed": "polar.evaluate.session_completed:SessionCompleted",
        "command": "polar.evaluate.command:CommandEvaluator",
        "test_on_output": "polar.evaluate.test_on_output:TestOnOutput",
        "swebench": "polar.evaluate.swebench:SWEBenchEvaluator",
        "harbor": "polar.evaluate.harbor:HarborEvaluator",
        "judge": "polar.evaluate.judge:Judge",
        "judge_group": "polar.evaluate.judge_group:GroupJudge",
    },
)


def evaluator_names() -> list[str]:
    """The built-ins and installed entry points (what a task over HTTP may name)."""
    return EVALUATORS.names()


def _factory(name: str) -> Callable[..., Any]:
    obj = EVALUATORS.load(name)
    if not callable(obj):
        raise ValueError(f"evaluator {name!r} is not a class or factory")
    return cast(Callable[..., Any], obj)


def _takes_config(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: try with the config
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _check(evaluator: Any, label: str) -> Evaluator:
    missing = [a for a in ("name", "needs_fresh_runtime") if not hasattr(evaluator, a)]
    if missing:
        raise ValueError(f"evaluator {label!r} lacks {', '.join(missing)}")
    if not inspect.iscoroutinefunction(getattr(evaluator, "evaluate", None)):
        raise ValueError(f"evaluator {label!r} needs an `async def evaluate(self, ctx)`")
    return cast(Evaluator, evaluator)


def get_evaluator(name_or_import_path: str, config: Mapping[str, Any] | None = None) -> Evaluator:
    """The evaluator for a task, its config validated; ValueError saying what is wrong otherwise."""
    factory = _factory(name_or_import_path)
    config = dict(config or {})
    if _takes_config(factory):
        try:
            evaluator = factory(config)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"evaluator {name_or_import_path!r}: {type(exc).__name__}: {exc}") from None
    elif config:
        raise ValueError(f"evaluator {name_or_import_path!r} takes no config, got {sorted(config)}")
    else:
        evaluator = factory()
    return _check(evaluator, name_or_import_path)


def fresh_runtime_wanted(evaluator: Evaluator, requested: bool | None) -> bool:
    """Whether the node prepares a fresh runtime: the task's `evaluator.fresh_runtime`, defaulting to what
    the evaluator asks; refusing a task that denies one to an evaluator that needs it."""
    if requested is None:
        return bool(evaluator.needs_fresh_runtime)
    if not requested and evaluator.needs_fresh_runtime:
        raise ValueError(
            f"evaluator {evaluator.name!r} needs a fresh runtime, but evaluator.fresh_runtime is false"
        )
    return requested


class FieldProblem(ValueError):
    """What is wrong with a task's evaluators, and the field (a dotted path in the task) that holds it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def _one(ev: EvaluatorConfig, where: str) -> tuple[Evaluator, bool]:
    try:
        evaluator = get_evaluator(ev.strategy, dict(ev.config))
    except Exception as exc:
        field = f"{where}.config" if ev.strategy in evaluator_names() else f"{where}.strategy"
        raise FieldProblem(field, str(exc).replace("evaluator.config", f"{where}.config")) from None
    try:
        fresh = fresh_runtime_wanted(evaluator, ev.fresh_runtime)
    except ValueError as exc:
        raise FieldProblem(f"{where}.fresh_runtime", str(exc).replace("evaluator.", f"{where}.")) from None
    return evaluator, fresh


def build_evaluator(task: Task) -> tuple[Evaluator, bool]:
    """The task's evaluator (its `evaluator`, or its `evaluators` combined as `reward` says) and whether
    the node prepares a fresh runtime for it; `FieldProblem` naming the field otherwise."""
    evaluator, fresh = _build(task)
    from polar.evaluate.judge_group import group_problem

    problem = group_problem(task)
    if problem is not None:
        raise FieldProblem(*problem)
    inner = [p.evaluator for p in evaluator.parts] if isinstance(evaluator, Combined) else [evaluator]
    if task.runtime.network == "host" and any(getattr(e, "calls_models", False) for e in inner):
        # The agent would share the host's network with the judge's server, which takes any caller.
        raise FieldProblem(
            "runtime.network",
            "host would let the agent reach the judge's server directly; a judged task runs with gateway "
            "(the default) or none",
        )
    return evaluator, fresh


def _build(task: Task) -> tuple[Evaluator, bool]:
    if not task.evaluators:
        if task.reward is not None:
            raise FieldProblem("reward", "combines the rewards of `evaluators`: name them there")
        return _one(task.evaluator, "evaluator")
    if task.evaluator != EvaluatorConfig():
        raise FieldProblem("evaluators", "give evaluator or evaluators, not both")
    reward = task.reward or RewardConfig()
    names = ", ".join(task.evaluators)
    for kind, given in (("weights", reward.weights), ("thresholds", reward.thresholds)):
        for name in given:
            if name not in task.evaluators:
                raise FieldProblem(
                    f"reward.{kind}.{name}", f"no evaluator is named {name!r} (evaluators: {names})"
                )
    parts = []
    for name, ev in task.evaluators.items():
        evaluator, fresh = _one(ev, f"evaluators.{name}")
        weight, threshold = reward.weights.get(name, 1.0), reward.thresholds.get(name)
        parts.append(Part(name, evaluator, dict(ev.config), fresh, ev.timeout_seconds, weight, threshold))
    wanting = [p.name for p in parts if p.fresh]
    if len(wanting) > 1:
        raise FieldProblem(
            f"evaluators.{wanting[1]}.fresh_runtime",
            f"only one evaluator gets the fresh runtime, and {wanting[0]!r} has it (both would change it)",
        )
    return Combined(parts, reward.combine), bool(wanting)
