"""One check of a task, for the rollout server (at submit: a 400) and the node (at admission: a 422).

The task schema (`polar.task`) rejects unknown fields and bad values. Here the harness is built with
its settings and the evaluator with its config, by the registries the nodes use, the trajectory builder is
resolved, and the cross-field rules are checked; so an unknown name, an import path that does not load, or a
bad setting is refused naming the field, and the node gets the built harness and evaluator it runs. What
depends on a node's host (is bwrap installed, may this node run `local`) stays with the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from polar.evaluate.registry import FieldProblem, build_evaluator
from polar.harness.extensions import Refused, check
from polar.harness.registry import get_harness, harness_names
from polar.runtime.factory import IMAGE_BACKENDS
from polar.task import Task
from polar.trajectory import get_builder


class TaskProblem(ValueError):
    """What is wrong with a task, and the field (a dotted path inside the task) that holds it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Resolved:
    """What a valid task names, built: the node runs these."""

    harness: Any
    evaluator: Any
    fresh_runtime: bool


def _http_url(field: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TaskProblem(field, f"must be an http(s) URL, not {url!r}")


def resolve_task(task: Task) -> Resolved:
    """The task's harness, evaluator and fresh-runtime need; `TaskProblem` naming the field otherwise."""
    agent = task.agent
    try:
        harness = get_harness(agent.harness, dict(agent.settings))
    except Exception as exc:
        field = "agent.settings" if agent.harness in harness_names() else "agent.harness"
        raise TaskProblem(field, str(exc)) from None
    try:
        check(agent.harness, harness, agent.mcp_servers, agent.skills)
    except Refused as exc:
        raise TaskProblem(exc.field, exc.message) from None
    try:
        evaluator, fresh = build_evaluator(task)  # `evaluator`, or `evaluators` combined as `reward` says
    except FieldProblem as exc:
        raise TaskProblem(exc.field, exc.message) from None
    try:
        get_builder(task.builder)
    except Exception as exc:
        raise TaskProblem("builder", str(exc)) from None
    if task.runtime.backend in IMAGE_BACKENDS and not task.runtime.image:
        raise TaskProblem("runtime.image", f"the {task.runtime.backend} runtime needs an image")
    if agent.side_call_backend is not None:
        _http_url("agent.side_call_backend.url", agent.side_call_backend.url)
    if task.callback_url is not None:
        _http_url("callback_url", task.callback_url)
    if task.early_stop_min_usable is not None and task.early_stop_min_usable > task.num_samples:
        raise TaskProblem(
            "early_stop_min_usable",
            f"{task.early_stop_min_usable} exceeds num_samples ({task.num_samples})",
        )
    return Resolved(harness, evaluator, fresh)
