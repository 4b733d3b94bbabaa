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
