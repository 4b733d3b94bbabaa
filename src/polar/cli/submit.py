"""`polar submit TASKFILE`: send a task file to the rollout server (and optionally wait for the results)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click
import orjson

from polar.cli.common import resolve_token, token_file_option

SERVER = "http://127.0.0.1:8300"


def locate(path: Path, param: str | None) -> str:
    """`file:line` of the field the server named (`tasks[i].field` counts tasks as the file lists them)."""
    from polar import yamlpos

    if not param:
        return str(path)
    try:
        doc = yamlpos.parse(path.read_text(), str(path))
    except (OSError, yamlpos.YAMLSyntaxError):
        return str(path)
    loc = yamlpos.parse_field_path(param)
    if loc[:1] == ("tasks",) and len(loc) > 1 and isinstance(loc[1], int):
        index, rest = loc[1], loc[2:]
        if isinstance(doc.data, dict) and "tasks" in doc.data:
            loc = ("tasks", index, *rest)
        elif isinstance(doc.data, list):
            loc = (index, *rest)
        else:
            loc = rest
    return doc.where(loc)


@click.command("submit")
@click.argument("taskfile", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--server", default=SERVER, show_default=True, envvar="POLAR_SERVER", metavar="URL")
@token_file_option
@click.option("--wait", is_flag=True, help="Stay until every session ended, printing each result.")
@click.option(
    "--out", type=click.Path(path_type=Path, dir_okay=False), help="With --wait: write results as JSONL."
)
@click.option(
    "--images",
    type=click.Choice(["check", "pull"]),
    default="check",
    show_default=True,
    help="The tasks' docker/podman images on the live nodes. check: an image no node holds stops the "
    "submission, naming it and the command that makes it; pull: submit, and the nodes pull the images they "
    "lack while earlier sessions run. (Nodes never build a submitted task's image: a Dockerfile runs code.)",
)
def submit(
    taskfile: Path, server: str, token_file: Path | None, wait: bool, out: Path | None, images: str
) -> None:
    """Submit the tasks in TASKFILE (YAML or JSON: one task, a list, or {tasks: [...]}).

    The file is checked here (errors name the file, line and field) and again by the server (unknown
    harness, evaluator or builder, bad settings), whose refusal is mapped back to the file's line.

    \b
    Before it submits, it asks the server which live nodes hold each container image the tasks run in
    (nodes report them: `polar node --report-images`, the default).

    \b
    Examples:
      polar submit examples/tasks.yaml --wait --out results.jsonl
      polar submit swe.yaml --images pull     # the nodes pull the images they lack from a registry
    """
    from polar.cli.common import CannotStart, command_name
    from polar.cli.run import Outcomes
    from polar.client import RolloutClient, RolloutError
    from polar.rollout import preflight
    from polar.rollout.taskfile import TaskFileError, load_tasks

    try:
        tasks = load_tasks(taskfile, resolve_imports=False)  # the server decides what code it runs
    except TaskFileError as exc:
        raise click.ClickException(str(exc)) from None
    if out is not None and not wait:
        raise click.BadParameter("needs --wait", param_hint="--out")
    token = resolve_token(token_file, create=False)

    outcomes = Outcomes()

    async def go() -> None:
        async with RolloutClient(server, token=token) as client:
            wanted = preflight.container_images(tasks)
            if images == "check" and wanted:
                problems, notes = preflight.fleet_image_problems(
                    tasks, await client.images_where(list(wanted)), taskfile
                )
                for note in notes:
                    click.echo(f"{command_name()}: {note}", err=True)
                if problems:
                    raise CannotStart("\n".join(f"{command_name()}: {p}" for p in problems))
            await client.submit(tasks)
            for t in tasks:
                click.echo(f"submitted {t.task_id}: {len(client.session_ids[t.task_id])} session(s)")
            if not wait:
                return
            sink = out.open("wb") if out is not None else None
            try:
                async for r in client.results([t.task_id for t in tasks]):
                    outcomes.add(r)
                    reward = "-" if r.reward is None else f"{r.reward:g}"
                    reason = f"  ({r.reason})" if r.reason else ""
                    click.echo(
                        f"{r.task_id} #{r.metadata.get('sample_index', '?')} {r.status} reward={reward}{reason}"
                    )
                    if sink is not None:
                        sink.write(orjson.dumps(r.model_dump(mode="json")) + b"\n")
            finally:
                if sink is not None:
                    sink.close()

    try:
        asyncio.run(go())
    except RolloutError as exc:
        where = locate(taskfile, exc.param) if exc.status == 400 else server
        raise click.ClickException(f"{where}: {exc}") from None
    outcomes.exit()  # as `polar run`: infrastructure failures, or none completed, exit 3
