"""Loading task files (YAML or JSON) with errors that point at the line.

A file holds one task, a list of tasks, or `{"tasks": [...]}`. Validation errors name the file, the line
and the field (`tasks.yaml:14: tasks[1].runtime.backend: Input should be 'local', 'bwrap', ...`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from polar.rollout.task import Task, UploadAction


class TaskFileError(ValueError):
    """A task file that cannot be used, with `path:line: field: reason` in its message."""


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the YAML node at `loc` (or of its deepest existing ancestor)."""
    line = None if node is None else node.start_mark.line + 1
    for step in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if getattr(k, "value", None) == step), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and 0 <= step < len(node.value):
            nxt = node.value[step]
        else:
            nxt = None
        if nxt is None:
            break
        node = nxt
        line = node.start_mark.line + 1
    return line


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


def parse_tasks(text: str, source: str = "<tasks>") -> list[Task]:
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise TaskFileError(f"{where}: not valid YAML/JSON: {getattr(exc, 'problem', exc)}") from None
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
        base = (*prefix, i) if (prefix or isinstance(data, list)) else ()
        try:
            tasks.append(Task.model_validate(item))
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc = (*base, *err["loc"])
            line = _line_of(root, loc)
            where = f"{source}:{line}" if line else source
            raise TaskFileError(f"{where}: {_path(loc) or 'task'}: {err['msg']}") from None
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


def load_tasks(path: str | Path) -> list[Task]:
    """Tasks from a file; relative upload `src` paths are taken relative to the file's directory."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TaskFileError(f"{p}: cannot read: {exc.strerror}") from None
    base = p.resolve().parent
    return [_anchor_uploads(t, base) for t in parse_tasks(text, str(p))]


# Public names for other YAML loaders that point their errors at the line (polar.train.config).
line_of = _line_of
field_path = _path
