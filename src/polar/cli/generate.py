"""`polar generate TASKS.yaml`: offline data generation (SFT data from a harness, as in the paper's Pi run).

It runs the task file exactly as `polar run` does (rollout server, one gateway node, any backend or the
embedded engine), keeps the sessions that pass the filter (`--status`, `--min-reward`), and writes them as
OpenAI-style conversations (`messages.*`: the main chain's prompt, assistant turns with tool calls, tool
results) and as token sequences (`tokens.*`: one trainer row per trace, the captured ids, mask and
logprobs). Rejected sessions stay in `results.jsonl` and the gateway store, so a stricter or looser filter
can be re-applied with `polar traces export --results`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from polar import interrupt
from polar.cli.common import setup_logging
from polar.cli.run import (
    Rollout,
    RunState,
    _console,
    exit_for,
    interrupted,
    rollout_options,
    run_taskfile,
)

_STATUSES = ("COMPLETED", "TIMEOUT", "ERROR", "CANCELLED")


def write_outputs(results: Iterable[Any], keep: Any, out: Path, formats: tuple[str, ...]) -> dict[str, Any]:
    """Write the kept sessions' conversations and token rows under `out`; return the counts."""
    from polar.train.export import (
        as_parquet_conversation,
        conversation_row,
        conversation_schema,
        result_rows,
    )
    from polar.trajectory.export import write_jsonl, write_parquet

    every = list(results)
    kept = [r for r in every if keep(r)]
    conversations = [row for r in kept if (row := conversation_row(r)) is not None]
    traces = list(result_rows(kept))
    for fmt in formats:
        if fmt == "jsonl":
            write_jsonl(conversations, out / "messages.jsonl")
            write_jsonl(traces, out / "tokens.jsonl")
        else:
            rows = (as_parquet_conversation(c) for c in conversations)
            write_parquet(rows, out / "messages.parquet", schema=conversation_schema())
            write_parquet(traces, out / "tokens.parquet")
    n = len(conversations)
    return {
        "sessions": len(every),
        "kept": n,
        "traces": len(traces),
        "messages": sum(len(c["messages"]) for c in conversations) / n if n else 0.0,
        "assistant_turns": sum(c["assistant_turns"] for c in conversations) / n if n else 0.0,
    }


def _summary(counts: dict[str, Any]) -> Table:
    table = Table(title="generated data")
    table.add_column("stat")
    table.add_column("value", justify="right")
    sessions, kept = counts["sessions"], counts["kept"]
    rate = f" ({100 * kept / sessions:.1f} %)" if sessions else ""
    table.add_row("sessions run", str(sessions))
    table.add_row("accepted", f"{kept}{rate}")
    table.add_row("token rows (traces)", str(counts["traces"]))
    table.add_row("messages per accepted session", f"{counts['messages']:.1f}")
    table.add_row("assistant turns per accepted session", f"{counts['assistant_turns']:.1f}")
    return table


@click.command("generate")
@click.argument("taskfile", type=click.Path(path_type=Path, dir_okay=False))
@rollout_options("polar-generate")
@click.option("--status", "statuses", multiple=True, type=click.Choice(_STATUSES), default=("COMPLETED",),
              show_default=True, help="Keep sessions that ended so (repeat for several).")  # fmt: skip
@click.option("--min-reward", type=float, default=None, help="Keep sessions whose reward is at least this.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet", "both"]), default="both",
              show_default=True)  # fmt: skip
def generate(
    taskfile: Path, rollout: Rollout, statuses: tuple[str, ...], min_reward: float | None, fmt: str
) -> None:
    """Run TASKFILE, keep the sessions that pass the filter, and export them as training data.

    \b
    Writes under OUT:
      messages.jsonl / .parquet  one conversation per accepted session (OpenAI Chat messages)
      tokens.jsonl / .parquet    one trainer row per trace of those sessions (ids, mask, logprobs)
      results.jsonl, gateway.db  every session, as `polar run` writes them

    An OUT holding an earlier run is resumed as `polar run` resumes it (--overwrite starts over); the
    data files are then written from every session, earlier ones included. Ctrl-C keeps what finished
    (results.jsonl) and exits with status 130; the data files are written when a run completes.

    \b
    Example (keep only sessions the evaluator passed):
      polar generate tasks.yaml --backend http://127.0.0.1:8000 --min-reward 1 --out sft-data
    """
    from polar.extras import PARQUET, require_cli
    from polar.train.export import Filter

    setup_logging(rollout.log_level, json=rollout.log_json)
    out = rollout.out
    interrupt.guard()
    formats = ("jsonl", "parquet") if fmt == "both" else (fmt,)
    if "parquet" in formats:  # before any session runs, not after all of them
        require_cli(PARQUET)
    console = _console()
    state = RunState(out)
    keep = Filter(statuses=statuses, min_reward=min_reward)
    try:
        results = run_taskfile(taskfile, rollout, state, console)
        counts = write_outputs(results, keep, out, formats)  # derived from results.jsonl: rewritten whole
    except KeyboardInterrupt:
        interrupted(state)
    console.print(_summary(counts))
    console.print(f"data: {out}/messages.*  {out}/tokens.*   all sessions: {out / 'results.jsonl'}")
    exit_for(results)
