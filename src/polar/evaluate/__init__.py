"""Evaluators: turn a finished session into rewards, fail-closed."""

from polar.evaluate.base import EvalContext, EvalResult, Evaluator
from polar.evaluate.command import CommandEvaluator
from polar.evaluate.registry import evaluator_names, fresh_runtime_wanted, get_evaluator
from polar.evaluate.session_completed import SessionCompleted
from polar.evaluate.support import EvaluatorError
from polar.evaluate.test_on_output import TestOnOutput

__all__ = [
    "CommandEvaluator",
    "EvalContext",
    "EvalResult",
    "Evaluator",
    "EvaluatorError",
    "SessionCompleted",
    "TestOnOutput",
    "evaluator_names",
    "fresh_runtime_wanted",
    "get_evaluator",
]
