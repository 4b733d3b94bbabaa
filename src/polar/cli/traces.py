"""`polar traces`: build, show, audit and export the trajectories of stored sessions.

Sessions are named by id, picked by `--task`, or (with neither) every session in the store. The command
logic takes records and trajectories (`show_session`, `audit_session`, ...) so it is testable without a
terminal; the click layer only opens the store and chooses sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import orjson
from rich.console import Console
from rich.table import Table

from polar import plugins
from polar.cli import FAILURES
from polar.extras import PARQUET, require_cli
from polar.store.records import CompletionRecord, SessionInfo
from polar.trajectory import AuditReport, BuildError, Trajectory, audit, build
from polar.trajectory.export import rows, write_jsonl, write_parquet

if TYPE_CHECKING:
    from polar.store.sqlite import SQLiteStore

F = TypeVar("F", bound=Callable[..., Any])

_STATS = (
    "calls",
    "traces",
    "merged_calls",
    "roots",
    "siblings",
    "breaks",
    "drift_turns",
    "drift_merged",
    "skipped",
    "prompt_tokens",
    "sampled_tokens",
    "untrainable_tokens",
    "trainable_tokens",
    "trainer_tokens",
    "coverage",
    "eot_id",
)


def stats_table(trajectory: Trajectory) -> Table:
    m = trajectory.metadata
    table = Table(title=f"session {m.get('session_id')} · {m.get('strategy')} · {trajectory.status.value}")
    table.add_column("stat")
    table.add_column("value", justify="right")
    for key in _STATS:
        if key in m:
            value = m[key]
            text = (
                f"{value:.6f}"
                if isinstance(value, float)
                else (orjson.dumps(value).decode() if isinstance(value, dict) else str(value))
            )
            table.add_row(key, text)
    return table


def traces_table(trajectory: Trajectory) -> Table:
    table = Table(title="traces")
    for name in ("#", "calls", "started by", "prompt", "response", "trainable", "finish", "drift turns"):
        table.add_column(
            name, justify="right" if name in ("#", "calls", "prompt", "response", "trainable") else "left"
        )
    for i, t in enumerate(trajectory.traces):
        m = t.metadata
        started = str(m.get("started_by", ""))
        if "sibling_of" in m:
            started += f" (sibling of #{m['sibling_of']})"
        elif "diverged_from" in m:
            started += f" (from #{m['diverged_from']})"
        table.add_row(
            str(i),
            str(len(m.get("completion_ids", ()))),
            started,
            str(len(t.prompt_ids)),
            str(len(t.response_ids)),
            str(sum(t.loss_mask)),
            str(t.finish_reason),
            ",".join(map(str, m.get("drift_turns", ()))),
        )
    return table


def audit_table(session_id: str, report: AuditReport) -> Table:
    verdict = "[green]passes[/green]" if report.ok else "[red]FAILS[/red]"
    table = Table(title=f"audit of session {session_id}: {verdict}")
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_row("traces / turns", f"{report.traces} / {report.turns}")
    table.add_row("turns with the exact server context", str(report.exact_turns))
    table.add_row("trainable / sampled tokens", f"{report.trainable_tokens} / {report.sampled_tokens}")
    table.add_row("coverage", f"{report.coverage:.6f}")
    table.add_row(
        "context drift (merged / split)",
        f"{sum(d.merged for d in report.drift)} / {sum(not d.merged for d in report.drift)}",
    )
    table.add_row("errors", str(len(report.errors)))
    return table


def show_session(console: Console, trajectory: Trajectory, *, traces: bool = True) -> None:
    console.print(stats_table(trajectory))
    if traces and trajectory.traces:
        console.print(traces_table(trajectory))


def audit_session(
    console: Console, session_id: str, trajectory: Trajectory, records: list[CompletionRecord]
) -> bool:
    report = audit(trajectory, records)
    console.print(audit_table(session_id, report))
    for e in report.errors[:50]:
        console.print(f"  [red]error[/red]: {e}", soft_wrap=True)
    if len(report.errors) > 50:
        console.print(f"  ... and {len(report.errors) - 50} more errors")
    for d in report.drift:
        how = "merged" if d.merged else "split"
        console.print(
            f"  drift ({how}): {d.completion_id} -> {d.next_completion_id}: re-rendered turn differs from "
            f"the {d.sampled_tokens} sampled tokens at token {d.diverges_at}",
            soft_wrap=True,
        )
    return report.ok


# -- click layer ------------------------------------------------------------------------------------------


def _sessions(store: SQLiteStore, session_ids: tuple[str, ...], task_id: str | None) -> list[SessionInfo]:
    if session_ids and task_id:
        raise click.UsageError("name sessions or --task, not both")
    if not session_ids:
        found: list[SessionInfo] = store.sessions(task_id)
        if not found:
            raise click.UsageError(
                f"no sessions for task {task_id!r}" if task_id else "the store holds no sessions"
            )
        return found
    known = {s.session_id: s for s in store.sessions()}
    missing = [s for s in session_ids if s not in known]
    if missing:
        raise click.BadParameter(f"no such session: {', '.join(missing)}", param_hint="SESSION_ID")
    return [known[s] for s in session_ids]


def _built(
    store_path: Path,
    session_ids: tuple[str, ...],
    task_id: str | None,
    strategy: str,
    options: dict[str, Any],
) -> Iterator[tuple[SessionInfo, Trajectory, list[CompletionRecord]]]:
    from polar.store.sqlite import SQLiteStore

    if not store_path.is_file():
        raise click.BadParameter(f"Path '{store_path}' does not exist.", param_hint="'--store'")
    if plugins.is_import_path(strategy):  # named on this command line by its user: theirs to trust
        try:
            plugins.trust_file_import(strategy, Path.cwd())
        except plugins.PluginError as e:
            raise click.BadParameter(str(e), param_hint="--strategy") from None
    store = SQLiteStore(store_path)
    try:
        for info in _sessions(store, session_ids, task_id):
            records = store.completions(info.session_id)
            try:
                trajectory = build(records, strategy, **options)
            except BuildError as e:
                raise click.BadParameter(
                    e.message, param_hint=f"--{(e.param or 'strategy').replace('_', '-')}"
                ) from None
            yield info, trajectory, records
    finally:
        store.close()


def _build_options(f: F) -> F:
    f = click.option(
        "--train-without-logprobs",
        is_flag=True,
        help="Train calls whose only defect is missing logprobs (logprobs None).",
    )(f)
    f = click.option(
        "--eot-id", type=int, default=None, help="End-of-turn token id (default: inferred from the records)."
    )(f)
    f = click.option("--on-drift", type=click.Choice(["split", "merge"]), default="split", show_default=True,
                     help="At a re-rendered turn that differs from the sampled tokens: split the chain, or merge anyway.")(f)  # fmt: skip
    f = click.option("--strategy", default="prefix_merging", show_default=True,
                     help="per_request, prefix_merging, a registered builder, or pkg.mod:func.")(f)  # fmt: skip
    f = click.option("--task", "task_id", default=None, help="Every session of this task.")(f)
    # Existence is checked when the store is opened, so `export --results` works without one.
    f = click.option("--store", "store_path", envvar="POLAR_STORE", default="polar.db", show_default=True,
                     type=click.Path(dir_okay=False, path_type=Path), help="The gateway's SQLite store (env POLAR_STORE).")(f)  # fmt: skip
    return click.argument("session_ids", metavar="[SESSION_ID]...", nargs=-1)(f)


def _options(
    strategy: str, on_drift: str, eot_id: int | None, train_without_logprobs: bool
) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if strategy == "prefix_merging":
        options = {"on_drift": on_drift, "eot_id": eot_id}
    if train_without_logprobs:
        options["train_without_logprobs"] = True
    return options


@click.group("traces")
def traces() -> None:
    """Build, audit and export trajectories from a store.

    Name sessions by id, pick them with --task, or give neither for every session in the store.
    """


@traces.command("show")
@_build_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print the trajectories as JSON (what the gateway serves)."
)
@click.option("--stats-only", is_flag=True, help="Only the reconstruction stats, not the trace list.")
def show(
    session_ids: tuple[str, ...], store_path: Path, task_id: str | None, strategy: str, on_drift: str,
    eot_id: int | None, train_without_logprobs: bool, as_json: bool, stats_only: bool,
) -> None:  # fmt: skip
    """Print the trajectories of sessions: reconstruction stats and one line per trace."""
    console = Console()
    options = _options(strategy, on_drift, eot_id, train_without_logprobs)
    for _, trajectory, _ in _built(store_path, session_ids, task_id, strategy, options):
        if as_json:
            click.echo(orjson.dumps(trajectory.model_dump(mode="json")).decode())
        else:
            show_session(console, trajectory, traces=not stats_only)


def _result_rows(
    results_path: Path, session_ids: tuple[str, ...], task_id: str | None, estimator: str | None
) -> Iterator[dict[str, Any]]:
    """Rows from a rollout results file (`polar run`/`generate`): the node's trajectories, with rewards,
    and with `estimator` their group-relative advantages and per-trajectory weights."""
    from polar.train.export import ResultsError, advantage_maps, read_results, result_rows, trajectory_of

    if session_ids and task_id:
        raise click.UsageError("name sessions or --task, not both")
    try:
        results = list(read_results(results_path))
    except ResultsError as e:
        raise click.BadParameter(str(e), param_hint="--results") from None
    wanted = set(session_ids)
    missing = wanted - {r.session_id for r in results}
    if missing:
        raise click.BadParameter(f"no such session: {', '.join(sorted(missing))}", param_hint="SESSION_ID")
    chosen = [
        r
        for r in results
        if (not wanted or r.session_id in wanted) and (task_id is None or r.task_id == task_id)
    ]
    if task_id is not None and not chosen:
        raise click.UsageError(f"no sessions for task {task_id!r}")
    if estimator is None:
        return result_rows(chosen)
    trajectories = [t for r in chosen if (t := trajectory_of(r)) is not None]
    try:
        advantages, weights, stats = advantage_maps(trajectories, estimator)  # type: ignore[arg-type]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--advantages") from None
    click.echo(
        f"{estimator} advantages over {stats.groups} groups ({stats.samples} sessions, {stats.masked} masked): "
        f"{stats.zero_variance_groups} groups without variance give no gradient"
    )
    return result_rows(chosen, advantages, weights)


@traces.command("export")
@_build_options
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="File to write; .jsonl or .parquet picks the format unless --format says.")  # fmt: skip
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default=None)
@click.option("--results", "results_path", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Export the trajectories of a rollout results file (polar run/generate) instead of "
                   "rebuilding them from the store: these carry the evaluator's rewards.")  # fmt: skip
@click.option("--advantages", "estimator", type=click.Choice(["grpo", "rloo", "dr_grpo"]), default=None,
              help="Fill the advantage and weight columns, grouping sessions by group id (needs --results: "
                   "advantages need rewards). Export whole groups: a partial group gives other baselines.")  # fmt: skip
def export(
    session_ids: tuple[str, ...], store_path: Path, task_id: str | None, strategy: str, on_drift: str,
    eot_id: int | None, train_without_logprobs: bool, out_path: Path, fmt: str | None,
    results_path: Path | None, estimator: str | None,
) -> None:  # fmt: skip
    """Write one row per trace as JSON Lines or Parquet (loadable with `datasets.load_dataset`).

    Columns: ids, loss mask, behaviour logprobs, reward, advantage, group, task, trajectory (session) and
    trace ids, policy version, status (docs/training.md maps them onto verl, slime, NeMo RL and TRL).
    Trajectories rebuilt from the store have no reward (the store holds calls, not evaluations); export
    --results for rewarded trajectories.
    """
    fmt = fmt or {".jsonl": "jsonl", ".parquet": "parquet"}.get(out_path.suffix)
    if fmt is None:
        raise click.BadParameter(
            "cannot tell the format from the file name; pass --format", param_hint="--format"
        )
    if fmt == "parquet":
        require_cli(PARQUET)
    every: Iterator[dict[str, Any]]
    if results_path is not None:
        every = _result_rows(results_path, session_ids, task_id, estimator)
    elif estimator is not None:
        raise click.BadParameter(
            "advantages need rewards, which the store does not hold: export --results",
            param_hint="--advantages",
        )
    else:
        options = _options(strategy, on_drift, eot_id, train_without_logprobs)
        built = _built(store_path, session_ids, task_id, strategy, options)
        every = (row for info, t, _ in built for row in rows(t, context=info.metadata))
    n = write_parquet(every, out_path) if fmt == "parquet" else write_jsonl(every, out_path)
    click.echo(f"wrote {n} traces to {out_path}")


@traces.command("audit")
@_build_options
def audit_cmd(
    session_ids: tuple[str, ...], store_path: Path, task_id: str | None, strategy: str, on_drift: str,
    eot_id: int | None, train_without_logprobs: bool,
) -> None:  # fmt: skip
    """Prove each session's trajectory against its records; exit 3 if any audit fails."""
    console = Console()
    options = _options(strategy, on_drift, eot_id, train_without_logprobs)
    failed = [
        info.session_id
        for info, trajectory, records in _built(store_path, session_ids, task_id, strategy, options)
        if not audit_session(console, info.session_id, trajectory, records)
    ]
    if failed:
        console.print(f"[red]audit failed for {len(failed)} session(s): {', '.join(failed)}[/red]")
        raise click.exceptions.Exit(FAILURES)
