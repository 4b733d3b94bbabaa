"""`polar generate TASKS.yaml`: offline data generation (SFT data from a harness, as in the paper's Pi run).

It runs the task file exactly as `polar run` does (rollout server, one gateway node, any backend or the
embedded engine), keeps the sessions that pass the filter (`--status`, `--min-reward`), and writes them as
OpenAI-style conversations (`messages.*`: the main chain's prompt, assistant turns with tool calls, tool
results) and as token sequences (`tokens.*`: one trainer row per trace, the captured ids, mask and
logprobs). Rejected sessions stay in `results.jsonl` and the gateway store, so a stricter or looser filter
can be re-applied with `polar traces export --results`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

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
@click.option("--backend", "backend_url", metavar="URL", help="Inference server (default: start the engine).")
@click.option(
    "--backend-kind", type=click.Choice(["vllm", "sglang", "openai"]), default="vllm", show_default=True
)
@click.option("--model", default=None, help="Served model name (default: what the backend lists).")
@click.option(
    "--policy", default=None, help="Model for the embedded engine (default: the offline tiny policy)."
)
@click.option(
    "--out", default="polar-generate", show_default=True, type=click.Path(path_type=Path, file_okay=False)
)
@click.option("--capacity", default=4, show_default=True, type=int, help="Sessions the node runs at once.")
@click.option("--status", "statuses", multiple=True, type=click.Choice(_STATUSES), default=("COMPLETED",),
              show_default=True, help="Keep sessions that ended so (repeat for several).")  # fmt: skip
@click.option("--min-reward", type=float, default=None, help="Keep sessions whose reward is at least this.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet", "both"]), default="both",
              show_default=True)  # fmt: skip
def generate(
    taskfile: Path, backend_url: str | None, backend_kind: str, model: str | None, policy: str | None,
    out: Path, capacity: int, statuses: tuple[str, ...], min_reward: float | None, fmt: str,
) -> None:  # fmt: skip
    """Run TASKFILE, keep the sessions that pass the filter, and export them as training data.

    \b
    Writes under OUT:
      messages.jsonl / .parquet  one conversation per accepted session (OpenAI Chat messages)
      tokens.jsonl / .parquet    one trainer row per trace of those sessions (ids, mask, logprobs)
      results.jsonl, gateway.db  every session, as `polar run` writes them

    \b
    Example (keep only sessions the evaluator passed):
      polar generate tasks.yaml --backend http://127.0.0.1:8000 --min-reward 1 --out sft-data
    """
    from polar.cli.run import _run
    from polar.rollout.taskfile import TaskFileError, load_tasks
    from polar.train.export import Filter

    console = Console()
    try:
        tasks = load_tasks(taskfile)
    except TaskFileError as exc:
        raise click.ClickException(str(exc)) from None
    if capacity < 1:
        raise click.BadParameter("must be at least 1", param_hint="--capacity")
    out.mkdir(parents=True, exist_ok=True)
    engine_server = None
    if backend_url is None:
        from polar.engine import Engine, create_engine_app
        from polar.serving import ServerThread

        with console.status("loading the policy (the default model is built once)"):
            engine = Engine.load(policy, start=False)
            engine_server = ServerThread(create_engine_app(engine, manage_engine=True)).start()
        backend_url, backend_kind, model = engine_server.url, "vllm", engine.name
        console.print(f"policy {engine.name} served by the embedded engine at {backend_url}")
    try:
        results = asyncio.run(_run(tasks, out, backend_url, backend_kind, model, capacity, console))
    finally:
        if engine_server is not None:
            engine_server.stop()
    keep = Filter(statuses=statuses, min_reward=min_reward)
    formats = ("jsonl", "parquet") if fmt == "both" else (fmt,)
    counts = write_outputs(results, keep, out, formats)
    console.print(_summary(counts))
    console.print(f"data: {out}/messages.*  {out}/tokens.*   all sessions: {out / 'results.jsonl'}")
