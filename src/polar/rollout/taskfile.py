"""Loading task files (YAML or JSON) with errors that point at the line.

A file holds one task, a list of tasks, or `{"tasks": [...]}`. Validation errors name the file, the line
and the field (`tasks.yaml:14: tasks[1].runtime.backend: Input should be 'bwrap', 'docker', ...`).

Import paths a file names (`agent.harness`, `evaluator.strategy`, `builder` as `module:Name`) are the user's
own code: for a local run they are resolved relative to the file's directory, imported, and trusted in this
process (`polar.plugins`); one that cannot be loaded is an error at its line. Each task of a local run is
then checked as the rollout server checks a submission (`check_local`: the harness built with its
settings, the evaluator with its config, the builder), so an unknown name is an error at its line, with the
closest registered name, before anything starts. Unknown fields get the closest field name
(`polar.hints`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from polar import hints, plugins, yamlpos
from polar.jsontypes import JSON
from polar.rollout.skillpaths import SkillPathError, inline_skill_paths
from polar.rollout.uploads import confine_upload
from polar.task import Task, UploadAction

if TYPE_CHECKING:
    from polar.netguard import OutboundPolicy

Locate = Callable[[tuple[Any, ...]], str]


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
    named = [(("evaluators", key, "strategy"), ev.strategy) for key, ev in task.evaluators.items()]
    for loc, name in [*((loc, get(task)) for loc, get in CODE_FIELDS), *named]:
        if plugins.is_import_path(name):
            try:
                plugins.trust_file_import(name, base)
            except plugins.PluginError as exc:
                raise TaskFileError(f"{locate(loc)}: {exc}") from None


def check_task(task: Task, locate: Callable[[tuple[Any, ...]], str]) -> None:
    """What the rollout server checks at submit (`polar.rollout.server.validate.check_task`: the harness
    built with its settings, the evaluator with its config, the builder, URLs), as a `TaskFileError` at
    the field's line, so a local run fails before anything starts."""
    from polar.rollout.server.validate import SubmitError
    from polar.rollout.server.validate import check_task as check

    try:
        check(task)
    except SubmitError as exc:
        loc = yamlpos.parse_field_path(exc.param)
        message = exc.message.removeprefix(f"{exc.param}: ").removeprefix(f"{exc.param} ")
        raise TaskFileError(f"{locate(loc)}: {message}") from None


def check_local(task: Task, base: Path, locate: Callable[[tuple[Any, ...]], str]) -> None:
    """Everything a task of a local run (`polar run`, `generate`, `train`) must pass before the run starts:
    its import paths resolved relative to `base` and trusted (`trust_imports`), `check_task`, and its
    runtime able to run on this machine (bwrap installed for the default, docker's CLI for docker), so a
    run whose every session would end ERROR says why at the task's line instead."""
    trust_imports(task, base, locate)
    check_task(task, locate)
    from polar.rollout.node.lifecycle import runtime_spec
    from polar.runtime.factory import check_runtime

    try:
        check_runtime(runtime_spec(task, None))
    except Exception as exc:
        raise TaskFileError(f"{locate(('runtime', 'backend'))}: {exc}") from None


def parse_tasks(
    text: str,
    source: str = "<tasks>",
    base: Path | None = None,
    *,
    resolve_imports: bool = False,
    num_samples: int | None = None,
    outbound: OutboundPolicy | None = None,
) -> list[Task]:
    """The tasks in `text`; with `base` (the file's directory) their uploads are anchored there and, with
    `resolve_imports`, the import paths they name are resolved relative to it and trusted, and each task is
    checked as the server would (`check_local`: a local run of the user's own file; `outbound`: its URLs,
    `check_outbound_urls`). `num_samples` replaces each task's (`polar train`'s `group_size`)."""
    try:
        doc = yamlpos.parse(text, source)
    except yamlpos.YAMLSyntaxError as exc:
        raise TaskFileError(f"{exc.where}: not valid YAML/JSON: {exc.problem}") from None
    data = doc.data
    prefix: tuple[Any, ...] = ()
    generated: list[tuple[Any, Callable[[tuple[Any, ...]], str]]] = []
    if isinstance(data, dict) and "dataset" in data:
        generated = dataset_items(doc, data, base or Path.cwd())
        items, prefix = data.get("tasks") or [], ("tasks",)
    elif isinstance(data, dict) and "tasks" in data:
        items, prefix = data["tasks"], ("tasks",)
    elif isinstance(data, list):
        items = data
    elif isinstance(data, dict):
        items, prefix = [data], ()
    else:
        raise TaskFileError(
            f"{source}: expected a task, a list of tasks, {{tasks: [...]}} or {{dataset: ...}}"
        )
    if not isinstance(items, list) or not (items or generated):
        raise TaskFileError(f"{source}: `tasks` must be a non-empty list")
    written = [
        (item, locator(doc, (*prefix, i) if (prefix or isinstance(data, list)) else ()))
        for i, item in enumerate(items)
    ]
    tasks: list[Task] = []
    located: list[tuple[Task, Locate]] = []
    for item, locate in [*generated, *written]:
        if base is not None:
            try:
                item = inline_skill_paths(item, base)
            except SkillPathError as exc:
                raise TaskFileError(
                    f"{locate(('agent', 'skills', exc.index, 'path'))}: {exc.reason}"
                ) from None
        try:
            task = Task.model_validate(item)
        except ValidationError as exc:
            loc, message = hints.validation_problem(exc, Task)
            raise TaskFileError(f"{locate(loc)}: {message}") from None
        if num_samples is not None:
            task = task.model_copy(update={"num_samples": num_samples})
        if base is not None:
            try:
                task = anchor_uploads(task, base)
            except UploadOutside as exc:
                raise TaskFileError(
                    f"{locate(('runtime', 'prepare', exc.index, 'src'))}: {exc.reason}"
                ) from None
            if resolve_imports:
                check_local(task, base, locate)
        tasks.append(task)
        located.append((task, locate))
    if outbound is not None:
        check_outbound_urls(located, outbound)
    ids = [t.task_id for t in tasks]
    dupes = sorted({t for t in ids if ids.count(t) > 1})
    if dupes:
        raise TaskFileError(f"{source}: duplicate task_id {', '.join(dupes)}")
    return tasks


def dataset_items(
    doc: yamlpos.Document, data: dict[str, Any], base: Path
) -> list[tuple[dict[str, Any], Callable[[tuple[Any, ...]], str]]]:
    """The tasks a file's `dataset:` (with its `defaults:`) generates, each with the locator of its errors:
    the `dataset` line, the instance, the field (`polar.rollout.datasets`)."""
    from polar.rollout.datasets import DatasetError, DatasetSpec, read_rows, swebench_tasks

    extra = sorted(set(data) - {"dataset", "defaults", "tasks"})
    if extra:
        raise TaskFileError(
            f"{doc.at((extra[0],))}: unknown key beside `dataset` (expected dataset, defaults, tasks)"
        )
    try:
        spec = DatasetSpec.model_validate(data["dataset"])
    except ValidationError as exc:
        loc, message = hints.validation_problem(exc, DatasetSpec)
        raise TaskFileError(f"{doc.at(('dataset', *loc))}: {message}") from None
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise TaskFileError(f"{doc.at(('defaults',))}: must be a mapping of task fields")
    from polar.rollout.harbor import HarborError, harbor_tasks

    try:
        if spec.format == "harbor":
            generated = harbor_tasks(base, spec, defaults)
        else:
            generated = swebench_tasks(read_rows(spec, base), spec, defaults, base)
    except HarborError as exc:  # located in the task's own files (task.toml:line, instruction.md)
        raise TaskFileError(str(exc)) from None
    except DatasetError as exc:
        field, _, reason = str(exc).partition(": ")
        loc = yamlpos.parse_field_path(field) if field.startswith("dataset") else ("dataset",)
        raise TaskFileError(f"{doc.at(loc)}: {reason}") from None

    def locate_in(iid: str) -> Callable[[tuple[Any, ...]], str]:
        def locate(loc: tuple[Any, ...]) -> str:
            # A field `defaults` sets is wrong there; any other came from the instance.
            node: JSON = defaults
            for step in loc:
                node = node.get(step) if isinstance(node, dict) else None
            where = doc.where(("defaults", *loc)) if node is not None else doc.where(("dataset", "path"))
            return f"{where}: dataset instance {iid}: {yamlpos.field_path(loc) or 'task'}"

        return locate

    return [(task, locate_in(task["task_id"])) for task in generated]


class UploadOutside(ValueError):
    """An upload `src` (at `index` in runtime.prepare) that leaves the directory it is relative to, or is
    not there."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


def anchor_uploads(task: Task, base: Path) -> Task:
    """Relative upload sources (and an image build's context) made absolute against `base`, so a task file
    works from any cwd. An upload source must stay inside `base`: an absolute one, or one that leads out
    through `..` or a symlink, raises `UploadOutside` (a task file must not make the node copy arbitrary host
    files into a sandbox). A build context is only read by `polar images build` on the operator's machine."""
    prepare = list(task.runtime.prepare)
    for i, action in enumerate(prepare):
        if not isinstance(action, UploadAction):
            continue
        if Path(action.src).is_absolute():
            raise UploadOutside(i, f"{action.src!r} is absolute; write it relative to {base}")
        try:
            confine_upload(base / action.src, (base,))
        except ValueError:
            where = (base / action.src).resolve()
            raise UploadOutside(i, f"{action.src!r} leads outside {base} (to {where})") from None
        if not (base / action.src).exists():  # else every session fails at its start, one by one
            raise UploadOutside(i, f"{action.src!r}: no such file or folder in {base}")
        prepare[i] = action.model_copy(update={"src": str(base / action.src)})
    update: dict[str, Any] = {}
    if prepare != task.runtime.prepare:
        update["prepare"] = prepare
    build = task.runtime.build
    if build is not None and not Path(build.context).is_absolute():
        update["build"] = build.model_copy(update={"context": str(base / build.context)})
    if not update:
        return task
    return task.model_copy(update={"runtime": task.runtime.model_copy(update=update)})


def load_tasks(
    path: str | Path,
    *,
    resolve_imports: bool = True,
    num_samples: int | None = None,
    outbound: OutboundPolicy | None = None,
) -> list[Task]:
    """Tasks from a file; upload `src` paths are taken relative to the file's directory and must stay in it,
    and so are import paths (trusted for this process, and every task checked as the server would) unless
    `resolve_imports` is False (a file sent to a remote server, which decides what code it runs and checks
    the names itself). `num_samples` replaces each task's. `outbound`: the policy the local run's server
    will hold the tasks' callback, side-call and judge URLs to, checked here at each URL's line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TaskFileError(f"{p}: cannot read: {exc.strerror}") from None
    return parse_tasks(
        text,
        str(p),
        p.resolve().parent,
        resolve_imports=resolve_imports,
        num_samples=num_samples,
        outbound=outbound,
    )


def check_outbound_urls(checked: list[tuple[Task, Locate]], policy: OutboundPolicy) -> None:
    """The tasks' callback, side-call and judge URLs against `policy`, as the rollout server vets them at
    submit (`polar.rollout.server.validate.check_outbound`), the first refused one a `TaskFileError` at its
    line: a local run would otherwise start and then have its submission refused."""
    from polar.rollout.server.validate import SubmitError, check_outbound

    try:
        asyncio.run(check_outbound([(task, f"{i}.") for i, (task, _) in enumerate(checked)], policy))
    except SubmitError as exc:
        index, _, field = exc.param.partition(".")
        locate = checked[int(index)][1]
        message = exc.message.removeprefix(f"{exc.param}: ")
        raise TaskFileError(f"{locate(yamlpos.parse_field_path(field))}: {message}") from None
