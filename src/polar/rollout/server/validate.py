"""Submit-time checks, so a task that cannot run fails at submit (a 400 naming the field), not mid-run.

The task itself is checked by `polar.rollout.resolve`, as the nodes check it at admission (server and nodes
are expected to share an installation, as `polar run` and one-image clusters do); here only what the server
alone decides: its outbound policy for callback, side-call and evaluator backend (judge) URLs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from polar.netguard import OutboundPolicy, OutboundRefused
from polar.rollout.resolve import TaskProblem, resolve_task
from polar.task import Task


class SubmitError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_task(task: Task, prefix: str = "") -> None:
    """Raise SubmitError naming the field (`prefix` locates the task in a list, e.g. 'tasks[2].')."""
    try:
        resolve_task(task)
    except TaskProblem as problem:
        raise SubmitError(str(problem), f"{prefix}{problem.field}") from None


async def check_outbound(tasks: Sequence[tuple[Task, str]], policy: OutboundPolicy) -> None:
    """The tasks' callback, side-call and judge URLs against the server's outbound policy (`polar.netguard`),
    resolved now: SubmitError names the first refused field and says why. Each distinct URL is resolved
    once per submission (a batch usually shares one callback URL)."""
    fields: list[tuple[str, str]] = []
    for task, prefix in tasks:
        side = task.agent.side_call_backend
        if side is not None:
            fields.append((f"{prefix}agent.side_call_backend.url", side.url))
        if task.callback_url is not None:
            fields.append((f"{prefix}callback_url", task.callback_url))
        evaluators = {
            "evaluator": task.evaluator,
            **{f"evaluators.{k}": v for k, v in task.evaluators.items()},
        }
        for where, ev in evaluators.items():
            backend = ev.config.get("backend")  # a frozen model the evaluator calls (a judge)
            if isinstance(backend, dict) and isinstance(backend.get("url"), str):
                fields.append((f"{prefix}{where}.config.backend.url", backend["url"]))
    urls = list(dict.fromkeys(url for _, url in fields))
    outcomes = await asyncio.gather(*(policy.vet(url) for url in urls), return_exceptions=True)
    refused = dict(zip(urls, outcomes, strict=True))
    for name, url in fields:
        err = refused[url]
        if isinstance(err, OutboundRefused):
            raise SubmitError(f"{name}: {url!r} is refused: {err}", name)
        if isinstance(err, BaseException):
            raise err
