"""Submit-time checks beyond the Task schema, so a task that cannot run fails at submit, not mid-run.

The schema already rejects unknown fields, bad numbers and an unknown runtime backend (a Literal). Here:
the harness, evaluator and trajectory builder must be registered names, or `package.module:attr` import
paths whose module this server can find (server and nodes are expected to share an environment; the
module is located, not imported, so a submission never runs code on the server); the callback URL must
be http(s); `early_stop_min_usable` cannot exceed `num_samples`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from urllib.parse import urlsplit

from polar.rollout.task import Task


class SubmitError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _registered(module: str, fn: str) -> list[str] | None:
    """The registry's names, or None when that registry is not part of this installation."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise
    names: Callable[[], list[str]] = getattr(mod, fn)
    return list(names())


def _harnesses() -> list[str] | None:
    return _registered("polar.harness.registry", "harness_names")


def _evaluators() -> list[str] | None:
    return _registered("polar.evaluate.registry", "evaluator_names")


def _builders() -> list[str] | None:
    from polar.trajectory import builders

    return list(builders())


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_name(value: str, known: list[str] | None, param: str, what: str) -> None:
    if ":" in value:
        module, _, attr = value.partition(":")
        if not module or not attr.isidentifier():
            raise SubmitError(f"{what} {value!r}: an import path looks like 'package.module:attr'", param)
        if not _module_exists(module):
            raise SubmitError(f"{what} {value!r}: module {module!r} is not importable", param)
        return
    if known is not None and value not in known:
        raise SubmitError(
            f"unknown {what} {value!r}; choose one of {', '.join(sorted(known))} or 'package.module:attr'",
            param,
        )


def check_task(task: Task, prefix: str = "") -> None:
    """Raise SubmitError naming the field (`prefix` locates the task in a list, e.g. 'tasks[2].')."""
    check_name(task.agent.harness, _harnesses(), f"{prefix}agent.harness", "harness")
    check_name(task.evaluator.strategy, _evaluators(), f"{prefix}evaluator.strategy", "evaluator")
    check_name(task.builder, _builders(), f"{prefix}builder", "trajectory builder")
    if task.callback_url is not None:
        parts = urlsplit(task.callback_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise SubmitError(
                f"callback_url must be an http(s) URL, not {task.callback_url!r}", f"{prefix}callback_url"
            )
    if task.early_stop_min_usable is not None and task.early_stop_min_usable > task.num_samples:
        raise SubmitError(
            f"early_stop_min_usable ({task.early_stop_min_usable}) exceeds num_samples ({task.num_samples})",
            f"{prefix}early_stop_min_usable",
        )
