"""Loading task files (YAML or JSON) with errors that point at the line.

A file holds one task, a list of tasks, or `{"tasks": [...]}`. Validation errors name the file, the line
and the field (`tasks.yaml:14: tasks[1].runtime.backend: Input should be 'local', 'bwrap', ...`).

Import paths a file names (`agent.harness`, `evaluator.strategy`, `builder` as `module:Name`) are the user's
own code: for a local run they are resolved relative to the file's directory, imported, and trusted in this
process (`polar.plugins`); one that cannot be loaded is an error at its line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from polar import plugins, yamlpos
from polar.rollout.task import Task, UploadAction


class TaskFileError(ValueError):
    """A task file that cannot be used, with `path:line: field: reason` in its message."""


# The task fields that name code, as (location in the task, getter).
CODE_FIELDS: tuple[tuple[tuple[str, ...], Any], ...] = (
    (("agent", "harness"), lambda t: t.agent.harness),
    (("evaluator", "strategy"), lambda t: t.evaluator.strategy),
    (("builder",), lambda t: t.builder),
)


def locator(doc: yamlpos.Document, prefix: tuple[Any, ...]) -> Callable[[tuple[Any, ...]], str]:
    """`locate(loc)`: the `file:line: field` of `loc` in the task at `prefix` of the YAML document."""

    def locate(loc: tuple[Any, ...]) -> str:
        return doc.at((*prefix, *loc), "task")

    return locate


def trust_imports(task: Task, base: Path, locate: Callable[[tuple[Any, ...]], str]) -> None:
    """Resolve and trust the import paths `task` names, relative to `base`; `locate(loc)` is the
    `file:line: field` prefix of an error at that location."""
    for loc, get in CODE_FIELDS:
        name = get(task)
        if plugins.is_import_path(name):
            try:
                plugins.trust_file_import(name, base)
            except plugins.PluginError as exc:
                raise TaskFileError(f"{locate(loc)}: {exc}") from None


def parse_tasks(text: str, source: str = "<tasks>", *, imports_from: Path | None = None) -> list[Task]:
    """Tasks from YAML/JSON text; with `imports_from`, the import paths they name are resolved relative to
    that directory and trusted (a local run of the user's own file)."""
    try:
        doc = yamlpos.parse(text, source)
    except yamlpos.YAMLSyntaxError as exc:
        raise TaskFileError(f"{exc.where}: not valid YAML/JSON: {exc.problem}") from None
    data = doc.data
    prefix: tuple[Any, ...] = ()
    if isinstance(data, dict) and "tasks" in data:
        items, prefix = data["tasks"], ("tasks",)
    elif isinstance(data, list):
        items = data
    elif isinstance(data, dict):
        items, prefix = [data], ()
    else:
        raise TaskFileError(f"{source}: expected a task, a list of tasks or {{tasks: [...]}}")
    if not isinstance(items, list) or not items:
        raise TaskFileError(f"{source}: `tasks` must be a non-empty list")
    tasks: list[Task] = []
    for i, item in enumerate(items):
        locate = locator(doc, (*prefix, i) if (prefix or isinstance(data, list)) else ())
        try:
            task = Task.model_validate(item)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            raise TaskFileError(f"{locate(tuple(err['loc']))}: {err['msg']}") from None
        if imports_from is not None:
            trust_imports(task, imports_from, locate)
        tasks.append(task)
    ids = [t.task_id for t in tasks]
    dupes = sorted({t for t in ids if ids.count(t) > 1})
    if dupes:
        raise TaskFileError(f"{source}: duplicate task_id {', '.join(dupes)}")
    return tasks


def _anchor_uploads(task: Task, base: Path) -> Task:
    """Relative upload sources made absolute against `base`, so a task file works from any cwd."""
    prepare = [
        a.model_copy(update={"src": str(base / a.src)})
        if isinstance(a, UploadAction) and not Path(a.src).is_absolute()
        else a
        for a in task.runtime.prepare
    ]
    if prepare == task.runtime.prepare:
        return task
    return task.model_copy(update={"runtime": task.runtime.model_copy(update={"prepare": prepare})})


def load_tasks(path: str | Path, *, resolve_imports: bool = True) -> list[Task]:
    """Tasks from a file; relative upload `src` paths are taken relative to the file's directory, and so
    are import paths (trusted for this process) unless `resolve_imports` is False (a file sent to a remote
    server, which decides what code it runs)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TaskFileError(f"{p}: cannot read: {exc.strerror}") from None
    base = p.resolve().parent
    tasks = parse_tasks(text, str(p), imports_from=base if resolve_imports else None)
    return [_anchor_uploads(t, base) for t in tasks]
