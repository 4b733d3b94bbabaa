"""Evaluators by name or import path, refused at submit time with a message that says why."""

from __future__ import annotations

from typing import Any

import pytest

from polar.evaluate import (
    CommandEvaluator,
    EvalContext,
    EvalResult,
    evaluator_names,
    fresh_runtime_wanted,
    get_evaluator,
)
from polar.task import EvaluatorConfig


class ScoresLength:
    """A custom evaluator taking its config: one reward per trace."""

    name = "scores_length"
    needs_fresh_runtime = False

    def __init__(self, config: dict[str, Any]) -> None:
        self.scale = float(config.get("scale", 1.0))

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return EvalResult(
            reward=None, trace_rewards=[self.scale * len(t.response_ids) for t in ctx.trajectory.traces]
        )


class NoConfig:
    name = "no_config"
    needs_fresh_runtime = True

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return EvalResult(reward=1.0)


class SyncEvaluate:
    name = "sync"
    needs_fresh_runtime = False

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        return EvalResult(reward=1.0)


class Nameless:
    needs_fresh_runtime = False

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return EvalResult(reward=1.0)


class Picky:
    name = "picky"
    needs_fresh_runtime = False

    def __init__(self, config: dict[str, Any]) -> None:
        raise KeyError("threshold")

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return EvalResult(reward=1.0)


NOT_CALLABLE = 3
HERE = __name__


def test_names() -> None:
    assert evaluator_names() == [
        "command",
        "harbor",
        "judge",
        "judge_group",
        "session_completed",
        "swebench",
        "test_on_output",
    ]


def test_each_builtin_is_registered_under_its_own_name() -> None:
    """The table names the classes by "module:Class" (imported on first use); each class's `name` is its key."""
    from polar.evaluate.registry import EVALUATORS
    from polar.plugins import import_path

    assert {key: import_path(path).name for key, path in EVALUATORS.builtin.items()} == {
        key: key for key in EVALUATORS.builtin
    }


def test_builtins_by_name() -> None:
    ev = get_evaluator("command", {"test_command": "make test"})
    assert isinstance(ev, CommandEvaluator) and ev.name == "command"
    assert get_evaluator("session_completed").name == "session_completed"
    assert get_evaluator("test_on_output", {"command": "true"}).name == "test_on_output"


def test_custom_by_import_path() -> None:
    ev = get_evaluator(f"{HERE}:ScoresLength", {"scale": 2})
    assert isinstance(ev, ScoresLength) and ev.scale == 2.0
    ev2 = get_evaluator(f"{HERE}:NoConfig")
    assert isinstance(ev2, NoConfig) and ev2.needs_fresh_runtime
    # Import paths load only from modules the operator allowed (the suite allows `tests`), not polar's own
    # or anything else: built-ins are named by their names.
    with pytest.raises(ValueError, match="not accepted from the network"):
        get_evaluator("polar.evaluate.command:CommandEvaluator", {"test_command": "x"})
    assert isinstance(get_evaluator("command", {"test_command": "x"}), CommandEvaluator)


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        (
            "sessoin_completed",
            {},
            "unknown evaluator 'sessoin_completed' (did you mean 'session_completed'?); registered: command",
        ),
        ("no_such_pkg.mod:Thing", {}, "import paths are not accepted from the network"),
        ("tests.no_such_mod:Thing", {}, "cannot import tests.no_such_mod"),
        (f"{HERE}:Missing", {}, f"{HERE} has no attribute 'Missing'"),
        (f"{HERE}:", {}, "is not an import path"),
        (f"{HERE}:NOT_CALLABLE", {}, "is not a class or factory"),
        (f"{HERE}:SyncEvaluate", {}, "needs an `async def evaluate"),
        (f"{HERE}:Nameless", {}, "lacks name"),
        (f"{HERE}:NoConfig", {"x": 1}, "takes no config, got ['x']"),
        (f"{HERE}:Picky", {}, "KeyError: 'threshold'"),
        ("command", {}, "evaluator 'command': evaluator.config: set exactly one of `runner`"),
        ("command", {"test_command": "t", "parse": "tap"}, "evaluator.config.parse: Input should be"),
        (
            "command",
            {"test_command": "t", "base_ref": "--output=x"},
            "evaluator.config.base_ref: must name a revision, not an option",
        ),
        ("command", {"test_command": "t", "timeout_seconds": -1}, "evaluator.config.timeout_seconds"),
        (
            "command",
            {"test_command": "t", "protect": "tests"},
            "evaluator.config.protect: Input should be a valid list",
        ),
        (  # a misspelt key is the error worth naming (it also leaves the real one missing)
            "command",
            {"test_cmd": "t"},
            "evaluator.config.test_cmd: Extra inputs are not permitted (did you mean test_command?)",
        ),
    ],
)
def test_refusals(name: str, config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        get_evaluator(name, config)
    assert message in str(info.value)


def test_unknown_extra_field_is_named() -> None:
    with pytest.raises(ValueError, match=r"evaluator\.config\.test_cmd: Extra inputs are not permitted"):
        get_evaluator("command", {"test_command": "t", "test_cmd": "t"})


@pytest.mark.parametrize(
    ("strategy", "config", "requested", "want"),
    [
        ("command", {"test_command": "t"}, None, True),
        ("command", {"test_command": "t"}, True, True),
        ("session_completed", {}, None, False),
        ("session_completed", {}, True, True),  # a task may still ask for one
        ("test_on_output", {"command": "t"}, False, False),
    ],
)
def test_fresh_runtime_wanted(
    strategy: str, config: dict[str, Any], requested: bool | None, want: bool
) -> None:
    cfg = EvaluatorConfig(strategy=strategy, config=config, fresh_runtime=requested)
    assert fresh_runtime_wanted(get_evaluator(cfg.strategy, cfg.config), cfg.fresh_runtime) is want


def test_fresh_runtime_denied_to_command() -> None:
    with pytest.raises(
        ValueError, match=r"'command' needs a fresh runtime, but evaluator\.fresh_runtime is false"
    ):
        fresh_runtime_wanted(get_evaluator("command", {"test_command": "t"}), False)
