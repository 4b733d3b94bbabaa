"""`polar run TASKS.yaml`: the whole rollout service on one machine, in one process.

It starts the rollout server, one gateway node and (unless `--backend` names an inference server) the
embedded engine, submits the task file through the trainer client, and writes one JSON line per finished
session under `--out`: a progress bar with live counts per stage on a terminal, one line per finished
session otherwise (a log file or CI shows progress as it happens).

Runs never destroy results (`polar.rollout.rundir`): an `--out` holding an earlier run is resumed, and
`--overwrite` is the only way to replace it. Ctrl-C stops cleanly: running sessions are cancelled (they
run again on resume), finished ones are kept, a summary says what and where, and the exit status is 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import click
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from polar import interrupt
from polar.cli import FAILURES
from polar.cli.common import (
    BACKEND_HELP,
    F,
    allow_callback_option,
    dashboard_options,
    expand_backends,
    logging_options,
    outbound_policy,
    polar_command,
    setup_logging,
)
from polar.cli.raycli import RayOptions, check_ray_options, ray_options
from polar.stack import PolicyServer

if TYPE_CHECKING:
    from polar.dashboard import DashboardOptions
    from polar.rollout.protocol import SessionResult
    from polar.rollout.ray.spec import RayPlacement
    from polar.rollout.rundir import ResultsFile, RunPlan
    from polar.task import Task

STAGES = ("INITIALIZING", "READY", "RUNNING", "POST_RUN", "BUILDING", "EVALUATING")


@dataclass(frozen=True)
class Rollout:
    """The settings `polar run` and `polar generate` share, built once from their options by
    `rollout_options` (which hands the command this instead of its ten options)."""

    policy: PolicyServer
    engine_model: str | None  # --policy: what the embedded engine serves when `policy` names no server
    out: Path
    overwrite: bool = False
    capacity: int = 4
    gateway_workers: int = 1  # --gateway-workers: the node's gateway on this many processes
    allow_callback: tuple[str, ...] = ()  # the outbound allowlist for task-given URLs (polar.netguard)
    log_level: str = "warning"
    log_json: bool = False
    images: str = "check"  # --images: check, build or pull the tasks' container images before starting


@dataclass(frozen=True)
class Launch:
    """What starting a checked run takes: its settings, where the node may read uploads from (the task
    file's folder), the dashboard's options (`polar run`), and the gateway nodes' Ray placement (--ray)."""

    rollout: Rollout
    upload_roots: tuple[Path, ...]
    dashboard: DashboardOptions | None = None
    placement: RayPlacement | None = None

    @property
    def policy(self) -> PolicyServer:
        return self.rollout.policy


@dataclass
class RunState:
    """What a run holds so far (results of earlier runs into the folder included): for the summary at the
    end, and the one Ctrl-C prints."""

    out: Path
    on_ray: bool = False  # its gateway nodes are Ray actors, each with its own records
    total: int = 0  # sessions the task file asks for
    results: dict[str, SessionResult] = field(default_factory=dict)  # by session id, in finish order
    new: int = 0  # of them finished by this run
    started: bool = False  # the sessions were submitted (Ctrl-C before: nothing ran)

    @property
    def records(self) -> Path:
        """Where the gateway's records are: OUT/gateway.db, or each Ray node's under OUT/nodes."""
        return self.out / ("nodes/*/gateway.db" if self.on_ray else "gateway.db")

    def add(self, result: SessionResult, *, new: bool) -> bool:
        if result.session_id in self.results:
            return False
        self.results[result.session_id] = result
        self.new += new
        return True


def _console() -> Console:
    """stdout: a terminal gets rich's width; a file or pipe lines that are not wrapped at 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _summary(results: list[SessionResult]) -> Table:
    # Fits an 80-column terminal with task ids of ~20 characters (rich cuts a wider table's cells to "…").
    table = Table(
        title="results",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        caption="reward: mean of those with one",
    )
    for col in ("task", "sessions", "completed", "timeout", "error", "reward", "passed"):
        table.add_column(col, justify="right" if col != "task" else "left")
    by_task: dict[str, list[SessionResult]] = defaultdict(list)
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


def session_line(result: SessionResult, n: int, total: int) -> str:
    """One finished session, as printed when stdout is not a terminal: task, sample, status, reward, time."""
    sample = result.metadata.get("sample_index", "?")
    reward = "-" if result.reward is None else f"{result.reward:.2f}"
    seconds = result.timings.get("total_s")
    took = "-" if seconds is None else f"{seconds:.1f}s"
    why = f"  ({result.reason})" if result.reason and result.status.value != "COMPLETED" else ""
    return f"[{n}/{total}] {result.task_id} sample {sample}: {result.status.value} reward {reward} in {took}{why}"


async def _run(
    tasks: list[Task], plan: RunPlan, state: RunState, sink: ResultsFile, launch: Launch, console: Console
) -> None:
    from polar.client import RolloutClient
    from polar.evaluate.judge_group import group_evaluator
    from polar.stack import local_stack

    live = console.is_terminal
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not live,
    )
    capacity = launch.rollout.capacity
    grouped = any(group_evaluator(t) is not None for t in tasks)  # results wait for a judge_group phase
    async with local_stack(
        state.out,
        launch.policy,
        capacity,
        gateway_workers=launch.rollout.gateway_workers,
        stop_reason="polar run finished",
        allow_callback=launch.rollout.allow_callback,
        upload_roots=launch.upload_roots,
        dashboard=launch.dashboard,
        ray=launch.placement,
    ) as stack:
        click.echo(f"dashboard: {stack.dashboard_url}")
        if stack.ray is not None:
            ids = ", ".join(stack.ray.node_ids())
            click.echo(f"gateway nodes on Ray: {ids} (records in {state.out / 'nodes'}/<node>/gateway.db)")
        with progress:
            done = progress.add_task("sessions finished", total=state.total, completed=len(state.results))
            stages = {s: progress.add_task(f"  {s.lower():<12}", total=capacity) for s in STAGES}
            judging = progress.add_task(f"  {'judging':<12}", total=state.total, visible=False)
            async with RolloutClient(stack.server_url, token=stack.token) as client:

                async def watch() -> None:
                    """The node's stages four times a second; with judge_group tasks, the server's group
                    phases once a second (a bar, or a line per group when stdout is not a terminal)."""
                    announced: set[str] = set()
                    for tick in itertools.count():
                        if live:
                            by_stage = stack.by_stage()
                            for stage, bar in stages.items():
                                progress.update(bar, completed=by_stage.get(stage, 0))
                        if grouped and tick % 4 == 0:
                            now = await _judging(client)
                            if live:
                                progress.update(judging, completed=sum(now.values()), visible=bool(now))
                            for task_id in sorted(now.keys() - announced) if not live else ():
                                click.echo(f"judging the group of {task_id}: {now[task_id]} session(s)")
                            announced |= now.keys()
                        await asyncio.sleep(0.25)

                watcher = asyncio.create_task(watch()) if live or grouped else None
                try:
                    fresh = [t for t in tasks if t.task_id not in plan.known]
                    if fresh:
                        await client.submit(fresh)
                    state.started = True
                    async for result in client.results([t.task_id for t in tasks]):
                        if not state.add(result, new=True):
                            continue  # finished in an earlier run: kept, already reported
                        sink.append(result)
                        progress.update(done, advance=1)
                        if not live:
                            click.echo(session_line(result, len(state.results), state.total))
                finally:
                    if watcher is not None:
                        watcher.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await watcher
                    for bar in (*stages.values(), judging):  # every session has left its stage
                        progress.update(bar, completed=0)


async def _judging(client: Any) -> dict[str, int]:
    """Tasks whose group the server is judging now, with their sessions (`GET /rollout/status`); none when
    the server does not answer (it is stopping: the results loop reports that)."""
    from polar.client import RolloutError

    try:
        status = await client.status()
    except RolloutError:
        return {}
    return dict((status.get("groups") or {}).get("judging") or {})


def policy_server(
    backend_urls: tuple[str, ...], backend_kind: str, model: str | None, render: str, tokenizer: str | None
) -> PolicyServer:
    """`rollout_options`' policy settings as one value (a usage error where they do not go together)."""
    if render == "gateway" and backend_kind == "openai":
        raise click.BadParameter(
            "renders to token ids for a vllm or sglang kind server, not openai", param_hint="--render gateway"
        )
    return PolicyServer(backend_urls, backend_kind, model, render, tokenizer)


def rollout_options(default_out: str) -> Callable[[F], F]:
    """The options `polar run` and `polar generate` share: where the policy is, where results go. The
    command gets them checked and as one value, `rollout: Rollout`, instead of ten keyword arguments."""

    def decorate(fn: F) -> F:
        options = [
            click.option("--backend", "backend_urls", metavar="URL", multiple=True, callback=expand_backends,
                         help=f"{BACKEND_HELP} Default: start the embedded engine."),
            click.option("--backend-kind", type=click.Choice(["vllm", "sglang", "openai"]), default="vllm",
                         show_default=True),
            click.option("--model", default=None, help="Served model name (default: what the backend lists)."),
            click.option("--policy", default=None,
                         help="Model for the embedded engine (default: the offline tiny policy)."),
            click.option("--render", type=click.Choice(["server", "gateway"]), default="server", show_default=True,
                         help="Who renders prompts. gateway: each session's exact token chain, sent to the "
                         "server as token ids (vllm kind, the embedded engine included; docs/backends.md)."),
            click.option("--tokenizer", metavar="NAME_OR_DIR", default=None,
                         help="The policy's tokenizer (a local folder, or a Hugging Face name already in the "
                         "cache; never downloaded): --render gateway renders with it (default: what the "
                         "server says it loaded), and `polar run`'s dashboard shows token text with it."),
            click.option("--out", default=default_out, show_default=True,
                         type=click.Path(path_type=Path, file_okay=False),
                         help="Output folder. One that holds an earlier run is resumed: its finished sessions "
                         "are kept, unfinished ones run, results.jsonl is appended to."),
            click.option("--overwrite", is_flag=True,
                         help="Replace the earlier run in --out instead of resuming it (removes only the "
                         "files polar writes there)."),
            click.option("--capacity", default=4, show_default=True, type=int,
                         help="Sessions the node runs at once."),
            click.option("--gateway-workers", default=1, show_default=True, type=int, metavar="N",
                         help="Serve the node's gateway from N processes, one store (as `polar node "
                         "--gateway-workers`; docs/gateway-workers.md): for many sessions with long "
                         "contexts, where one core would be busy recording."),
            click.option("--images", type=click.Choice(["check", "build", "pull"]), default="check",
                         show_default=True,
                         help="The tasks' docker/podman images before any session starts. check: a missing "
                         "one stops the run with the command that makes it; build: build those with a "
                         "runtime.build first (as `polar images build`); pull: pull the missing ones."),
            allow_callback_option,
            logging_options("warning"),
        ]  # fmt: skip

        @functools.wraps(fn)
        def command(**kw: Any) -> object:
            policy = policy_server(
                kw.pop("backend_urls"),
                kw.pop("backend_kind"),
                kw.pop("model"),
                kw.pop("render"),
                kw.pop("tokenizer"),
            )
            for name in ("capacity", "gateway_workers"):
                if kw[name] < 1:
                    raise click.BadParameter("must be at least 1", param_hint=f"--{name.replace('_', '-')}")
            outbound_policy(kw["allow_callback"])  # a bad entry is a usage error before anything starts
            # Every field but the two built above is an option of the same name, taken by keyword.
            named = {f.name: kw.pop(f.name) for f in dataclasses.fields(Rollout)[2:]}
            rollout = Rollout(policy=policy, engine_model=kw.pop("policy"), **named)
            return fn(rollout=rollout, **kw)

        wrapped: Callable[..., object] = command
        for option in reversed(options):
            wrapped = option(wrapped)
        return cast(F, wrapped)

    return decorate


def run_taskfile(
    taskfile: Path,
    rollout: Rollout,
    state: RunState,
    console: Console,
    *,
    dashboard: DashboardOptions | None = None,
    ray: RayOptions | None = None,
    check_only: bool = False,
) -> list[Any]:
    """Load and check TASKFILE (errors at file:line: fields, harness/evaluator/builder names and settings,
    import paths) before anything loads, resume or start the run in `state.out`, start the embedded engine
    (serving `rollout.engine_model`) unless `rollout.policy` names servers (and something is left to run),
    run every unfinished session through a local server and node, and return every finished session's
    result (earlier runs' too). `ray`: gateway nodes as Ray actors instead of the one node."""
    from polar.modelsource import ModelNotFound, prepare_model
    from polar.rollout.ray.cluster import RayError  # imports no Ray
    from polar.rollout.rundir import ResultsFile, RunDirError, locked, plan_run
    from polar.rollout.taskfile import TaskFileError, load_tasks

    try:
        tasks = load_tasks(taskfile, outbound=outbound_policy(rollout.allow_callback))
    except TaskFileError as exc:
        raise click.ClickException(str(exc)) from None
    backend = rollout.policy
    placement = _ray_placement(ray, tasks, rollout, taskfile) if ray is not None else None
    if not backend.urls:
        from polar.extras import ENGINE, require_cli

        require_cli(ENGINE)
        try:
            prepare_model(rollout.engine_model)
        except ModelNotFound as exc:
            raise click.BadParameter(str(exc), param_hint="--policy") from None
    if placement is None:  # Ray's nodes have their own images and network: they check at their start
        _check_ready(tasks, taskfile, backend, rollout.images)
    if check_only:  # --check: nothing is started or written
        sessions = sum(t.num_samples for t in tasks)
        policy_at = ", ".join(backend.urls) or "the embedded engine"
        click.echo(
            f"{taskfile}: {len(tasks)} task(s), {sessions} session(s): ready to run against {policy_at}"
        )
        return []
    out = state.out
    made = not out.exists()  # a start that fails leaves no folder behind it
    try:
        with contextlib.ExitStack() as ray_session:
            if placement is not None:  # before the run folder is touched: a Ray that is not there is one line
                from polar.rollout.ray.cluster import connect, disconnect

                if connect(placement.address):
                    ray_session.callback(disconnect)
            ray_session.enter_context(locked(out))
            plan = plan_run(out, tasks, overwrite=rollout.overwrite, source=taskfile)
            state.total = plan.total
            for result in plan.finished:
                state.add(result, new=False)
            click.echo(plan.describe(out))
            with ResultsFile(out / "results.jsonl") as sink:
                for result in plan.finished:  # finished before a crash could write them
                    sink.append(result)
                if not plan.nothing_to_run:
                    roots = (taskfile.resolve().parent,)  # where load_tasks confined the uploads
                    launch = Launch(rollout, roots, dashboard, placement)
                    _serve_and_run(tasks, plan, state, sink, launch, console)
    except RunDirError as exc:
        raise click.ClickException(str(exc)) from None
    except RayError as exc:  # Ray unreachable, or no Ray node can host a gateway node
        _unmake(out, made, state)
        raise click.ClickException(str(exc)) from None
    except BaseException:
        _unmake(out, made, state)
        raise
    return list(state.results.values())


def _check_ready(tasks: list[Any], taskfile: Path, backend: PolicyServer, images: str = "check") -> None:
    """Everything the sessions need is there (`polar.rollout.preflight`), or one line per problem, exit 2.
    `images` build or pull: the images are made first (what fails to is then one of the problems)."""
    from polar.cli.common import CannotStart, command_name
    from polar.rollout import preflight

    if images != "check":
        from polar.cli.images import collect, make

        wanted = collect(tasks)
        if wanted:
            make(wanted, pull=images == "pull")
    problems = preflight.image_problems(tasks, taskfile)
    if backend.urls:
        problems = preflight.backend_problems(backend.kind, backend.urls, backend.model) + problems
    if problems:
        raise CannotStart("\n".join(f"{command_name()}: {p}" for p in problems))


def _unmake(out: Path, made: bool, state: RunState) -> None:
    """A run that stopped before it submitted a session made nothing worth keeping in a folder it created:
    remove that folder (never one that was there before), so a second try starts as new."""
    from polar.rollout.rundir import LOCK, RUN_FILES, remove

    if not made or state.started or not out.is_dir():
        return
    remove(out, [*RUN_FILES, LOCK, "nodes"])
    with contextlib.suppress(OSError):
        out.rmdir()  # only when empty: anything else in it stays


def _serve_and_run(
    tasks: list[Task], plan: RunPlan, state: RunState, sink: ResultsFile, launch: Launch, console: Console
) -> None:
    with contextlib.ExitStack() as stack:
        if not launch.policy.urls:
            from polar.stack import embedded_engine

            loading = "loading the policy (the default model is built once)"
            if not console.is_terminal:  # a log file shows it at once; a terminal gets a spinner
                click.echo(loading)
            with console.status(loading):
                engine, engine_server = stack.enter_context(embedded_engine(launch.rollout.engine_model))
            policy = dataclasses.replace(
                launch.policy, urls=(engine_server.url,), kind="vllm", model=engine.name
            )
            launch = dataclasses.replace(launch, rollout=dataclasses.replace(launch.rollout, policy=policy))
            click.echo(f"policy {engine.name} served by the embedded engine at {engine_server.url}")
            dashboard = launch.dashboard
            if dashboard is not None and dashboard.decode is None:  # the token view shows the policy's text
                from polar.dashboard.tokens import decoder

                name = f"{engine.name} (the embedded engine's)"
                dashboard = dataclasses.replace(dashboard, tokenizer=name, decode=decoder(engine.tokenizer))
                launch = dataclasses.replace(launch, dashboard=dashboard)
        each = " on each gateway node" if launch.placement is not None else ""
        click.echo(f"running {plan.to_run} sessions, {launch.rollout.capacity} at a time{each}")
        interrupt.run(_run(tasks, plan, state, sink, launch, console))


def _ray_placement(ray: RayOptions, tasks: list[Task], rollout: Rollout, taskfile: Path) -> RayPlacement:
    """--ray: what each gateway node takes (the task file's runtime.cpus and memory_mb, and a CPU for each
    gateway worker, unless given)."""
    from polar.rollout.ray.spec import NodeRequest, RayPlacement, trusted_imports

    try:
        request = NodeRequest.for_tasks(
            tasks,
            rollout.capacity,
            resource=ray.resource,
            cpus=ray.cpus,
            memory_mb=ray.memory_mb,
            gateway_workers=rollout.gateway_workers,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--ray-resource") from None
    return RayPlacement(
        address=ray.address or None,
        request=request,
        log_level=ray.log_level,
        trusted_imports=trusted_imports(tasks, taskfile.resolve().parent),
    )


def interrupted(state: RunState) -> NoReturn:
    """Ctrl-C or SIGTERM: say what was kept and where, then exit with status 130 or 143 (no traceback, no
    "Aborted!")."""
    if not state.started and not state.out.exists():
        click.echo("interrupted before any session started: nothing was written")
        raise click.exceptions.Exit(interrupt.exit_status())
    unfinished = max(0, state.total - len(state.results))
    cancelled = "cancelled the running sessions; " if state.started else ""
    click.echo(f"interrupted: {cancelled}nothing finished was lost")
    if state.total:
        click.echo(
            f"kept {len(state.results)} of {state.total} sessions in {state.out / 'results.jsonl'} "
            f"({state.new} finished by this run); records in {state.records}"
        )
        if unfinished:
            click.echo(f"{unfinished} sessions left: run the same command again to resume them")
    raise click.exceptions.Exit(interrupt.exit_status())


@dataclass
class Outcomes:
    """The exit rule of the commands that run sessions (`polar run`, `generate`, `submit --wait`), kept as
    results stream by: status 3 (`polar.cli.FAILURES`) when sessions ended in an infrastructure failure,
    which a plain re-run of `polar run` retries, or when none completed. Rewards do not count: a policy that
    fails every task ran correctly."""

    sessions: int = 0
    completed: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # infrastructure failures by reason

    def add(self, result: SessionResult) -> None:
        from polar.rollout.rewards import infrastructure_failure

        self.sessions += 1
        self.completed += result.status.value == "COMPLETED"
        if infrastructure_failure(result.status.value, result.reason):
            self.failed[re.split(r"[:(]", result.reason or result.status.value)[0].strip()] += 1

    def exit(self) -> None:
        """Say why and exit 3 when the rule says so; return otherwise."""
        failed = sum(self.failed.values())
        if failed:
            why = "; ".join(f"{n}x {reason}" for reason, n in self.failed.most_common(2))
            click.echo(
                f"{failed} of {self.sessions} sessions ended in an infrastructure failure, not the policy's "
                f"doing ({why}): fix it and run the same command again to retry just those",
                err=True,
            )
            raise click.exceptions.Exit(FAILURES)
        if self.sessions and not self.completed:
            click.echo(f"none of the {self.sessions} sessions completed", err=True)
            raise click.exceptions.Exit(FAILURES)


def exit_for(results: list[Any]) -> None:
    """`Outcomes.exit` over a finished run's results."""
    outcomes = Outcomes()
    for result in results:
        outcomes.add(result)
    outcomes.exit()


@click.command("run")
@click.argument("taskfile", type=click.Path(path_type=Path, dir_okay=False))
@rollout_options("polar-run")
@ray_options(run=True)
@click.option(
    "--check",
    "check_only",
    is_flag=True,
    help="Check TASKFILE and what its sessions need (inference server, model, uploads, images), then stop: "
    "nothing is started or written. Exit 0 when ready, 2 with one line per problem.",
)
def run(
    taskfile: Path,
    rollout: Rollout,
    ray_address: str | None,
    ray_resource: str | None,
    ray_cpus: float | None,
    ray_memory_mb: int | None,
    check_only: bool,
) -> None:
    """Run every task in TASKFILE end to end on this machine and write the results.

    Writes OUT/results.jsonl (one line per session: task id, session id, status, reward, trajectory), the
    gateway's records (OUT/gateway.db) and the server's state (OUT/server.db), then prints a summary.

    If OUT holds an earlier run (the same command again, after Ctrl-C or a crash), it is resumed: finished
    sessions are kept, unfinished ones run, and results.jsonl gets only the results it lacks. --overwrite
    starts over instead. Ctrl-C cancels what runs, keeps what finished, and exits with status 130.

    While it runs, the dashboard is at the printed `dashboard:` URL (it carries this run's token in the
    part after `#`, which the browser never sends; see docs/dashboard.md): sessions live, their
    conversations, records and token view, and a cancel button.

    \b
    Examples (offline, built-in agent, embedded engine):
      polar run examples/tasks.yaml --out polar-run
      polar run tasks.yaml --backend URL --tokenizer Qwen/Qwen3-0.6B   # token view as text, not ids
      polar run tasks.yaml --backend http://gpu1:8000 --ray             # gateway nodes as Ray actors
      polar run tasks.yaml --ray head:6379 --ray-resource polar --capacity 16 --backend @servers.txt
      polar run tasks.yaml --backend URL --model M --check   # only check; start nothing
      polar run tasks.yaml --render gateway   # one token chain per session (token ids to the server)
      polar run tasks.yaml --backend URL --capacity 256 --gateway-workers 2   # the gateway on 2 cores
    (On the embedded engine the token view shows text without --tokenizer: it uses the engine's.)

    With --ray, each Ray node offering what a gateway node takes runs one (as a Ray actor) with --capacity
    sessions, its gateway on --gateway-workers processes; the server on this machine places sessions on
    them (docs/deploy.md).
    """
    setup_logging(rollout.log_level, json=rollout.log_json)
    interrupt.guard()
    check_ray_options(ray_address, ray_resource, ray_cpus, ray_memory_mb)
    ray = None
    if ray_address is not None:
        ray = RayOptions(ray_address, ray_resource, ray_cpus, ray_memory_mb, rollout.log_level)
    dashboard = dashboard_options(rollout.policy.tokenizer)
    console = _console()
    out = rollout.out
    state = RunState(out, on_ray=ray is not None)
    try:
        results = run_taskfile(
            taskfile, rollout, state, console, dashboard=dashboard, ray=ray, check_only=check_only
        )
    except KeyboardInterrupt:
        interrupted(state)
    if check_only:
        return
    console.print(_summary(results))
    console.print(f"results: {out / 'results.jsonl'}   records: {state.records}")
    console.print(f"browse them: {polar_command()} dashboard {out}")  # the run's own dashboard ended with it
    exit_for(results)
