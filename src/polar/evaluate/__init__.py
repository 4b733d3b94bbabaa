"""Evaluators: turn a finished session into rewards, fail-closed."""

from polar.evaluate.base import EvalContext, EvalResult, Evaluator

__all__ = ["EvalContext", "EvalResult", "Evaluator"]
