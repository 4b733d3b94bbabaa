"""What a node checks of a session spec before it admits it: the task resolves, its runtime is one this node
allows, and nothing it asks to see or upload is the node's own state or another session's files.

The checks read only the spec and the node's config; what the node's memory and journal say (seen before,
full, draining) is `Node.submit`'s part."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from polar.auth import default_token_file
from polar.rollout.node.config import NodeConfig
from polar.rollout.node.lifecycle import runtime_spec
from polar.rollout.protocol import SessionSpec
from polar.rollout.resolve import Resolved, TaskProblem, resolve_task
from polar.rollout.uploads import upload_violations
from polar.runtime.factory import check_runtime


class AdmissionError(Exception):
    """A session the node will not take: `status` is the HTTP status to answer, `field` what was wrong."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def validate(spec: SessionSpec, config: NodeConfig) -> Resolved:
    """The spec's task resolved (harness, evaluator) once every check passed; `AdmissionError` (422) naming
    the first field that did not."""
    task = spec.task
    try:
        resolved = resolve_task(task)
    except TaskProblem as problem:
        raise AdmissionError(422, f"task.{problem}", f"task.{problem.field}") from None
    try:
        runtime = runtime_spec(task, config.runtime_root, config.sandbox_paths)
        check_runtime(runtime)
    except Exception as exc:
        raise AdmissionError(422, f"task.runtime: {exc}", "task.runtime.backend") from exc
    for field, asked, allowed in (
        ("backend", runtime.backend, config.allowed_runtimes),
        ("network", runtime.network, config.allowed_networks),
    ):
        if allowed is not None and asked not in allowed:
            raise AdmissionError(
                422,
                f"task.runtime.{field}: {asked!r} is not allowed on this node (allowed: {', '.join(allowed)})",
                f"task.runtime.{field}",
            )
    for i, path in enumerate(task.runtime.read_only_paths):
        why = private_path(path, config)
        if why is not None:
            field = f"task.runtime.read_only_paths[{i}]"
            raise AdmissionError(422, f"{field}: {path!r} {why}", field)
    for i, reason in upload_violations(task, config.upload_roots):
        field = f"task.runtime.prepare[{i}].src"
        raise AdmissionError(422, f"{field}: {reason}", field)
    return resolved


def private_path(path: str, config: NodeConfig) -> str | None:
    """Why a sandbox may not see `path` (it is or holds the node's stores or token, or lies among the
    session directories), or None."""
    store = config.gateway.store_path.resolve()
    held = [store, store.with_name(store.name + "-wal"), default_token_file().resolve()]
    sessions = (config.runtime_root or Path(tempfile.gettempdir())).resolve()
    target = Path(os.path.realpath(path))
    for item in held:
        if item == target or item.is_relative_to(target):
            return f"holds the node's own state ({item})"
    if target == sessions or sessions.is_relative_to(target):
        return f"holds the session directories ({sessions})"
    if config.runtime_root is not None and target.is_relative_to(sessions):
        return f"lies among the session directories ({sessions})"
    if target.parent == sessions and target.name.startswith("polar-"):
        return "is a session directory"
    return None
