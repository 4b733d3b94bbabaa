"""Where an upload prepare action may read from: the one check task files and nodes share.

An upload copies a host path into the runtime, so whoever writes the task chooses what the node reads: a
task file may only name paths inside its own directory, and a node only paths inside the roots it was
given (`polar node --upload-root`; `polar run` gives the task file's directory). Paths are resolved first,
so neither `..` nor a symlink leads out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from polar.task import Task, UploadAction


def confine_upload(src: str | Path, roots: Sequence[Path]) -> Path:
    """`src` with symlinks and `..` resolved, when it lies inside one of `roots`; ValueError otherwise."""
    if not roots:
        raise ValueError(
            f"{str(src)!r}: this node reads no host files for uploads (start it with --upload-root DIR "
            "naming the directory the task files upload from)"
        )
    resolved = Path(src).resolve()
    if not any(resolved.is_relative_to(Path(root).resolve()) for root in roots):
        names = ", ".join(str(r) for r in roots)
        raise ValueError(f"{str(src)!r} resolves to {resolved}, outside the allowed upload roots ({names})")
    return resolved


def upload_violations(task: Task, roots: Sequence[Path]) -> Iterator[tuple[int, str]]:
    """(index in runtime.prepare, reason) of every upload whose `src` lies outside `roots`."""
    for i, action in enumerate(task.runtime.prepare):
        if isinstance(action, UploadAction):
            try:
                confine_upload(action.src, roots)
            except ValueError as exc:
                yield i, str(exc)
