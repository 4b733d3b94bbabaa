"""What a local run (`polar run`, `polar generate`) needs, checked before its first session.

Without these checks a run whose inference server is down, whose model name is wrong or whose container
image is not on this machine still starts every session, each fails on its own a few seconds later, and the
run ends with every session ERROR. Each check answers in one line naming what is missing and what to do; the
CLI prints them all and exits 2 before it creates anything. Upload sources are checked where the task file
is read (`taskfile.anchor_uploads`), at their line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polar.runtime.images import ENGINES, image_missing
from polar.task import Task

PROBE_TIMEOUT_S = 10.0
# Answers that say the server is up but will not list its models to us (a key it wants, an OpenAI-compatible
# server without /v1/models): the run may still work, so they are not a problem to stop for.
_CANNOT_LIST = frozenset({401, 403, 404, 405})


def backend_problems(kind: str, urls: Sequence[str], model: str | None) -> list[str]:
    """One line per inference server that does not answer `GET /v1/models`, or does not serve `model`."""
    return asyncio.run(_backend_problems(kind, urls, model))


async def _backend_problems(kind: str, urls: Sequence[str], model: str | None) -> list[str]:
    from polar.gateway.backends import make_backend
    from polar.gateway.backends.base import BackendOptions
    from polar.gateway.errors import GatewayError

    options = BackendOptions(timeout_s=PROBE_TIMEOUT_S, connect_timeout_s=PROBE_TIMEOUT_S, retries=0)
    problems = []
    for url in urls:
        backend = make_backend(kind, url, options)
        await backend.start()
        try:
            models = await backend.list_models()
        except GatewayError as err:
            if err.status not in _CANNOT_LIST:
                problems.append(f"--backend {url}: {err.message}")
            continue
        finally:
            await backend.aclose()
        if model is not None and models and model not in models:
            served = ", ".join(models[:5]) + (", ..." if len(models) > 5 else "")
            problems.append(f"--model {model}: not served by {url} (it serves {served})")
    return problems


def image_problems(tasks: Sequence[Task], taskfile: Path) -> list[str]:
    """One line per container image a task runs in that its engine does not have (or an engine that is not
    there), with the command that makes it."""
    wanted = container_images(tasks)
    built = {(t.runtime.backend, t.runtime.image) for t in tasks if t.runtime.build is not None}
    problems = []
    for (engine, image), task_ids in wanted.items():
        missing = image_missing(engine, image)
        if missing is None:
            continue
        which = (
            f"task {task_ids[0]}"
            if len(task_ids) == 1
            else f"tasks {task_ids[0]} and {len(task_ids) - 1} more"
        )
        if (engine, image) in built:
            fix = f"build it: polar images build {taskfile} --engine {engine} (or run with --images build)"
        else:
            fix = f"pull or build it: {engine} pull {image} (or run with --images pull)"
        problems.append(f"{which}: {engine} image {image}: {missing}; {fix}")
    return problems


def container_images(tasks: Sequence[Task]) -> dict[tuple[str, str], list[str]]:
    """(engine, image) -> the ids of the tasks that run in it, in task order."""
    wanted: dict[tuple[str, str], list[str]] = {}
    for task in tasks:
        rt = task.runtime
        if rt.backend in ENGINES and rt.image is not None:
            wanted.setdefault((rt.backend, rt.image), []).append(task.task_id)
    return wanted


def fleet_image_problems(
    tasks: Sequence[Task], where: Mapping[str, Any], taskfile: Path
) -> tuple[list[str], list[str]]:
    """`polar submit`'s check against the server's `POST /images/where` answer: one problem per image that
    no live node reporting its engine's images holds or is fetching, and notes for what cannot be checked
    (no live node, or none that reports images of that engine)."""
    wanted = container_images(tasks)
    answers = {(a["engine"], a["image"]): a for a in where.get("images", [])}
    reporting: Mapping[str, list[str]] = where.get("reporting", {})
    problems: list[str] = []
    unchecked: set[str] = set()
    for (engine, image), task_ids in wanted.items():
        if not reporting.get(engine):
            unchecked.add(engine)
            continue
        answer = answers.get((engine, image), {})
        if answer.get("held_by") or answer.get("fetching_on"):
            continue
        which = (
            f"task {task_ids[0]}"
            if len(task_ids) == 1
            else f"tasks {task_ids[0]} and {len(task_ids) - 1} more"
        )
        nodes = len(reporting[engine])
        problems.append(
            f"{which}: {engine} image {image}: on none of the {nodes} live node(s) that report their {engine} "
            f"images; build it on the nodes (polar images build {taskfile} --engine {engine}) or have them "
            f"pull it (polar submit {taskfile} --images pull)"
        )
    notes = []
    if not where.get("nodes"):
        notes.append("no gateway node is live: the images were not checked")
    elif unchecked:
        notes.append(
            f"no live node reports its {' or '.join(sorted(unchecked))} images: those were not checked"
        )
    return problems, notes
