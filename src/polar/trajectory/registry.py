"""Builders by name: the two built-ins, any registered one (`register_builder`, or a `polar.builders`
entry point), or an import path "pkg.mod:func" where `polar.plugins` allows one (a local task file, or a
module the operator allowed; never a bare import path from the network).

A builder is `fn(records, *, status, **options) -> Trajectory`, records being one session's
`CompletionRecord`s in call order. `build` checks what every builder relies on (one session, unique
completion ids, known options) so bad input fails with a `BuildError` naming the parameter, never deep in
a builder.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, cast

from polar import plugins
from polar.store.records import CompletionRecord
from polar.trajectory.errors import BuildError
from polar.trajectory.models import Trajectory, TrajectoryStatus

Builder = Callable[..., Trajectory]

BUILDERS = plugins.Registry(
    "builder",
    {
        "per_request": "polar.trajectory.per_request:per_request",
        "prefix_merging": "polar.trajectory.prefix_merging:prefix_merging",
    },
)


def register_builder(name: str, builder: Builder | str, *, replace: bool = False) -> None:
    """Make `builder` (a callable or an import path "pkg.mod:func") available as `strategy=name`."""
    obj = _import(builder) if isinstance(builder, str) else builder
    try:
        BUILDERS.register(name, obj, replace=replace)
    except plugins.PluginError as exc:
        raise BuildError(str(exc), param="name") from None


def builders() -> list[str]:
    return BUILDERS.names()


def _import(path: str) -> Builder:
    """A builder the calling program names in code (`register_builder`): not policed."""
    try:
        obj = plugins.import_path(path)
    except plugins.PluginError as exc:
        raise BuildError(f"cannot load builder {path!r}: {exc}", param="strategy") from None
    if not callable(obj):
        raise BuildError(f"builder {path!r} is not callable", param="strategy")
    return cast(Builder, obj)


def get_builder(strategy: str) -> Builder:
    """The builder a task names: a built-in or registered name, an entry point, or an import path that
    `polar.plugins` allows; BuildError otherwise."""
    try:
        obj = BUILDERS.load(strategy)
    except plugins.PluginError as exc:
        raise BuildError(str(exc), param="strategy") from None
    if not callable(obj):
        raise BuildError(f"builder {strategy!r} is not callable", param="strategy")
    result: Builder = obj
    return result


def build(
    records: Iterable[CompletionRecord],
    strategy: str = "prefix_merging",
    *,
    status: TrajectoryStatus | str = TrajectoryStatus.COMPLETED,
    **options: Any,
) -> Trajectory:
    """One session's records as a `Trajectory`, built by `strategy` with `options`."""
    builder = get_builder(strategy)
    try:
        status = TrajectoryStatus(status)
    except ValueError:
        allowed = [s.value for s in TrajectoryStatus]
        raise BuildError(f"status must be one of {allowed}, not {status!r}", param="status") from None
    recs = sorted(records, key=lambda r: r.seq)
    sessions = {r.session_id for r in recs}
    if len(sessions) > 1:
        raise BuildError(
            f"records span {len(sessions)} sessions; build one session at a time", param="records"
        )
    ids = [r.completion_id for r in recs]
    if len(set(ids)) != len(ids):
        raise BuildError("records repeat a completion_id", param="records")
    try:
        inspect.signature(builder).bind(recs, status=status, **options)
    except TypeError as e:
        raise BuildError(f"strategy {strategy!r} does not take these options: {e}", param="options") from None
    trajectory = builder(recs, status=status, **options)
    if not isinstance(trajectory, Trajectory):
        raise BuildError(f"builder {strategy!r} returned {type(trajectory).__name__}, not a Trajectory")
    return trajectory
