"""`polar run TASKS.yaml`: the whole rollout service on one machine, in one process.

It starts the rollout server, one gateway node and (unless `--backend` names an inference server) the
embedded engine, submits the task file through the trainer client, shows a progress bar with live counts per
stage, and writes one JSON line per finished session under `--out`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import click
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from polar.cli.common import allow_callback_option, outbound_policy

STAGES = ("INITIALIZING", "READY", "RUNNING", "POST_RUN", "BUILDING", "EVALUATING")


def _summary(results: list[Any]) -> Table:
    table = Table(title="results")
    for col in ("task", "sessions", "completed", "timeout", "error", "mean reward", "passed"):
        table.add_column(col, justify="right" if col != "task" else "left")
    by_task: dict[str, list[Any]] = defaultdict(list)
    for r in results:
        by_task[r.task_id].append(r)
    for task_id, rs in sorted(by_task.items()):
        counts = Counter(r.status.value for r in rs)
        rewards = [r.reward for r in rs if r.reward is not None]
        mean = f"{sum(rewards) / len(rewards):.2f}" if rewards else "-"
        table.add_row(
            task_id,
            str(len(rs)),
            str(counts["COMPLETED"]),
            str(counts["TIMEOUT"]),
            str(counts["ERROR"] + counts["CANCELLED"]),
            mean,
            f"{sum(1 for x in rewards if x >= 1.0)}/{len(rs)}",
        )
    return table


async def _run(
    tasks: list[Any],
    out: Path,
    backend_url: str,
    backend_kind: str,
    model: str | None,
    capacity: int,
    console: Console,
    allow_callback: tuple[str, ...] = (),
) -> list[Any]:
    from polar.client import RolloutClient
    from polar.rollout.local import local_stack

    results: list[Any] = []
    total = sum(t.num_samples for t in tasks)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    async with local_stack(
        out,
        backend_url,
        backend_kind,
        model,
        capacity,
        stop_reason="polar run finished",
        allow_callback=allow_callback,
    ) as stack:
        node = stack.node
        with progress, open(out / "results.jsonl", "wb") as sink:
            done = progress.add_task("sessions finished", total=total)
            stages = {s: progress.add_task(f"  {s.lower():<12}", total=capacity) for s in STAGES}

            async def watch() -> None:
                while True:
                    by_stage = node.status().by_stage
                    for stage, bar in stages.items():
                        progress.update(bar, completed=by_stage.get(stage, 0))
                    await asyncio.sleep(0.25)

            watcher = asyncio.create_task(watch())
            try:
                async with RolloutClient(stack.server_url, token=stack.token) as client:
                    async for result in client.run(tasks):
                        results.append(result)
                        sink.write(orjson.dumps(result.model_dump(mode="json")) + b"\n")
                        sink.flush()
                        progress.update(done, advance=1)
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
                for bar in stages.values():  # every session has left its stage
                    progress.update(bar, completed=0)
    return results


def rollout_options(default_out: str) -> Any:
    """The options `polar run` and `polar generate` share: where the policy is, where results go."""

    def decorate(fn: Any) -> Any:
        options = [
            click.option("--backend", "backend_url", metavar="URL",
                         help="Inference server (default: start the engine)."),
            click.option("--backend-kind", type=click.Choice(["vllm", "sglang", "openai"]), default="vllm",
                         show_default=True),
            click.option("--model", default=None, help="Served model name (default: what the backend lists)."),
            click.option("--policy", default=None,
                         help="Model for the embedded engine (default: the offline tiny policy)."),
            click.option("--out", default=default_out, show_default=True,
                         type=click.Path(path_type=Path, file_okay=False)),
            click.option("--capacity", default=4, show_default=True, type=int,
                         help="Sessions the node runs at once."),
            allow_callback_option,
        ]  # fmt: skip
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def run_taskfile(
    taskfile: Path,
    backend_url: str | None,
    backend_kind: str,
    model: str | None,
    policy: str | None,
    out: Path,
    capacity: int,
    console: Console,
    allow_callback: tuple[str, ...] = (),
) -> list[Any]:
    """Load TASKFILE (errors at file:line), start the embedded engine unless a backend is given, run every
    session through a local server and node, and return the results."""
    from polar.rollout.taskfile import TaskFileError, load_tasks

    try:
        tasks = load_tasks(taskfile)
    except TaskFileError as exc:
        raise click.ClickException(str(exc)) from None
    if capacity < 1:
        raise click.BadParameter("must be at least 1", param_hint="--capacity")
    outbound_policy(allow_callback)  # a bad entry is a usage error before anything starts
    if backend_url is None:
        from polar.extras import ENGINE, require_cli

        require_cli(ENGINE)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if backend_url is None:
            from polar.rollout.local import embedded_engine

            with console.status("loading the policy (the default model is built once)"):
                engine, engine_server = stack.enter_context(embedded_engine(policy))
            backend_url, backend_kind, model = engine_server.url, "vllm", engine.name
            console.print(f"policy {engine.name} served by the embedded engine at {backend_url}")
        return asyncio.run(
            _run(tasks, out, backend_url, backend_kind, model, capacity, console, allow_callback)
        )


@click.command("run")
@click.argument("taskfile", type=click.Path(path_type=Path, dir_okay=False))
@rollout_options("polar-run")
def run(
    taskfile: Path,
    backend_url: str | None,
    backend_kind: str,
    model: str | None,
    policy: str | None,
    out: Path,
    capacity: int,
    allow_callback: tuple[str, ...],
) -> None:
    """Run every task in TASKFILE end to end on this machine and write the results.

    Writes OUT/results.jsonl (one line per session: task id, session id, status, reward, trajectory), the
    gateway's records (OUT/gateway.db) and the server's state (OUT/server.db), then prints a summary.

    \b
    Example (offline, built-in agent, embedded engine):
      polar run examples/tasks.yaml --out polar-run
    """
    console = Console()
    results = run_taskfile(
        taskfile, backend_url, backend_kind, model, policy, out, capacity, console, allow_callback
    )
    console.print(_summary(results))
    console.print(f"results: {out / 'results.jsonl'}   records: {out / 'gateway.db'}")
