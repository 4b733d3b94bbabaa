"""`polar status [TASK]`: the rollout server's state, or one task's sessions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from polar.cli.common import resolve_token, token_file_option
from polar.cli.submit import SERVER


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _overview(console: Console, status: dict[str, Any], nodes: list[dict[str, Any]]) -> None:
    console.print(f"tasks:    {_counts(status['tasks'])}")
    console.print(f"sessions: {_counts(status['sessions'])}")
    groups = status.get("groups") or {}
    if groups.get("held_sessions"):
        judging = groups.get("judging") or {}
        now = ", ".join(f"{task_id} ({n})" for task_id, n in judging.items()) or "none yet"
        console.print(f"groups:   {groups['held_sessions']} result(s) held for judge_group; judging {now}")
    security = status.get("security") or {}
    if security.get("auth_refused") or security.get("results_refused"):
        console.print(
            f"[red]refused: {security['auth_refused']} request(s) with a missing or wrong control token, "
            f"{security['results_refused']} result(s) not from the node their session was dispatched to[/red]"
        )
        for item in security.get("recent", [])[-5:]:
            what = item.get("request") or f"result for {item.get('session_id')}"
            console.print(f"  {item['kind']}: {what} from {item['client']}: {item['why']}")
    table = Table("node", "url", "load", "health", "stages")
    for n in nodes:
        health = (
            "lost" if n["lost"] else ("draining" if n["draining"] else ("ok" if n["healthy"] else "silent"))
        )
        if n.get("auth_error"):
            health = f"refuses our token ({n['auth_error']})"
        stages = _counts((n.get("status") or {}).get("by_stage", {}))
        table.add_row(n["node_id"], n["url"], f"{n['load']}/{n['capacity']}", health, stages)
    console.print(table if nodes else "nodes:    none registered")


def _task(console: Console, view: dict[str, Any]) -> None:
    reason = f" ({view['reason']})" if view.get("reason") else ""
    console.print(f"{view['task_id']}: {view['state']}{reason}, {_counts(view['counts'])}")
    rewards = {r["session_id"]: r.get("reward") for r in view.get("results", [])}
    table = Table("#", "session", "status", "node", "reward", "reason")
    for s in view["sessions"]:
        reward = rewards.get(s["session_id"])
        table.add_row(
            str(s["sample_index"]),
            s["session_id"],
            s["status"],
            s["node_id"] or "-",
            "-" if reward is None else f"{reward:g}",
            s["reason"] or "",
        )
    console.print(table)
    failed = [c for c in view["callbacks"] if c["state"] != "delivered"]
    for c in failed:
        console.print(f"callback {c['state']} after {c['attempts']} attempt(s): {c['last_error'] or ''}")


@click.command("status")
@click.argument("task_id", required=False)
@click.option("--server", default=SERVER, show_default=True, envvar="POLAR_SERVER", metavar="URL")
@token_file_option
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON.")
def status(task_id: str | None, server: str, token_file: Path | None, as_json: bool) -> None:
    """Show the server's tasks, sessions and nodes; with TASK_ID, that task's sessions and rewards.

    \b
    Examples:
      polar status                                   # the server at POLAR_SERVER or the default
      polar status repair-slugify --server http://head:8300
      polar status --json | jq .sessions
    """
    from polar.client import RolloutClient, RolloutError

    token = resolve_token(token_file, create=False)

    async def go() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        async with RolloutClient(server, token=token, retry_window_s=1) as client:
            if task_id is not None:
                return await client.task(task_id, results=True), []
            return await client.status(), await client.nodes()

    try:
        data, nodes = asyncio.run(go())
    except RolloutError as exc:
        raise click.ClickException(f"{server}: {exc}") from None
    if as_json:
        click.echo(json.dumps(data if task_id else {**data, "nodes": nodes}, indent=2))
        return
    console = Console()
    if task_id is not None:
        _task(console, data)
    else:
        _overview(console, data, nodes)
