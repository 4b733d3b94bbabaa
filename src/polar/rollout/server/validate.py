"""Submit-time checks beyond the Task schema, so a task that cannot run fails at submit, not mid-run.

The schema already rejects unknown fields, bad numbers and an unknown runtime backend (a Literal). Here the
harness is built with its settings and the evaluator with its config, by the same registries the nodes use
(`polar.harness.registry`, `polar.evaluate.registry`), and the trajectory builder is resolved; so an
unknown name, an import path that does not load, or a bad setting is a 400 naming the field. (Server and
nodes are expected to share an installation, as `polar run` and one-image clusters do.) Checks that depend
on the node's host (is `bwrap` or `docker` installed?) stay with the node, which refuses such a session
with the reason and the server records it as ERROR.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from urllib.parse import urlsplit

from polar.evaluate.registry import evaluator_names, fresh_runtime_wanted, get_evaluator
from polar.harness.registry import get_harness, harness_names
from polar.netguard import OutboundPolicy, OutboundRefused
from polar.rollout.task import Task
from polar.trajectory import get_builder


class SubmitError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_task(task: Task, prefix: str = "") -> None:
    """Raise SubmitError naming the field (`prefix` locates the task in a list, e.g. 'tasks[2].')."""
    agent = task.agent
    try:
        get_harness(agent.harness, dict(agent.settings))
    except Exception as exc:
        known = agent.harness in harness_names()
        field = "agent.settings" if known else "agent.harness"
        raise SubmitError(f"{field}: {exc}", f"{prefix}{field}") from None
    ev = task.evaluator
    try:
        evaluator = get_evaluator(ev.strategy, dict(ev.config))
    except Exception as exc:
        field = "evaluator.config" if ev.strategy in evaluator_names() else "evaluator.strategy"
        raise SubmitError(f"{field}: {exc}", f"{prefix}{field}") from None
    try:
        fresh_runtime_wanted(evaluator, ev.fresh_runtime)
    except ValueError as exc:
        raise SubmitError(f"evaluator.fresh_runtime: {exc}", f"{prefix}evaluator.fresh_runtime") from None
    try:
        get_builder(task.builder)
    except Exception as exc:
        raise SubmitError(f"builder: {exc}", f"{prefix}builder") from None
    if task.runtime.backend in ("docker", "podman", "apptainer") and not task.runtime.image:
        raise SubmitError(
            f"runtime.image: the {task.runtime.backend} runtime needs an image", f"{prefix}runtime.image"
        )
    side = task.agent.side_call_backend
    if side is not None:
        parts = urlsplit(side.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            field = "agent.side_call_backend.url"
            raise SubmitError(f"{field} must be an http(s) URL, not {side.url!r}", f"{prefix}{field}")
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


async def check_outbound(tasks: Sequence[tuple[Task, str]], policy: OutboundPolicy) -> None:
    """The tasks' callback and side-call URLs against the server's outbound policy (`polar.netguard`),
    resolved now: SubmitError names the first refused field and says why. Each distinct URL is resolved
    once per submission (a batch usually shares one callback URL)."""
    fields: list[tuple[str, str]] = []
    for task, prefix in tasks:
        side = task.agent.side_call_backend
        if side is not None:
            fields.append((f"{prefix}agent.side_call_backend.url", side.url))
        if task.callback_url is not None:
            fields.append((f"{prefix}callback_url", task.callback_url))
    urls = list(dict.fromkeys(url for _, url in fields))
    outcomes = await asyncio.gather(*(policy.vet(url) for url in urls), return_exceptions=True)
    refused = dict(zip(urls, outcomes, strict=True))
    for name, url in fields:
        err = refused[url]
        if isinstance(err, OutboundRefused):
            raise SubmitError(f"{name}: {url!r} is refused: {err}", name)
        if isinstance(err, BaseException):
            raise err
