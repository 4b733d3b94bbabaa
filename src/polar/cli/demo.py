"""`polar demo`: the quickstart, on embedded defaults.

It starts the embedded engine (the offline default policy unless `--model` names another), puts the
capturing gateway in front of it with a SQLite store, and drives it like harnesses do: a multi-turn tool
loop through the official `openai` SDK (Chat, streaming and not), then one call in each other dialect
(Responses, Anthropic Messages, Gemini) over plain HTTP. It then rebuilds the trajectories, audits them
against the records and exports them to JSONL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import httpx
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from polar.cli.common import logging_options, polar_command, setup_logging

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in the workspace and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command line"}},
            "required": ["command"],
        },
    },
}
TASK = "Create hello.txt containing the words 'hello from polar', then say done."


def _agent_loop(
    base_url: str, key: str, model: str, turns: int, max_tokens: int, on_turn: Callable[[], None]
) -> None:
    """A harness-like loop: the model's turn is sent back verbatim, tools answered, history grows."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the bash tool to act."},
        {"role": "user", "content": TASK},
    ]
    for turn in range(turns):
        kwargs: dict[str, Any] = {"model": model, "messages": messages, "tools": [BASH_TOOL]}
        kwargs["max_tokens"] = max_tokens
        if turn % 2:  # streaming and not, as real harnesses mix them
            stream = client.chat.completions.create(**kwargs, stream=True)
            content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            message: dict[str, Any] = {"role": "assistant", "content": content}
        else:
            out = client.chat.completions.create(**kwargs).choices[0].message
            message = out.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"})
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "(ran) exit 0"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": f"Turn {turn + 1}: keep going."})
        on_turn()


def _other_dialects(base_url: str, keys: dict[str, str], model: str, max_tokens: int) -> None:
    """One call each in the dialects Codex, Claude Code and Gemini CLI speak."""
    from openai import OpenAI

    OpenAI(base_url=base_url + "/v1", api_key=keys["responses"], max_retries=0).responses.create(
        model=model, instructions="Be brief.", input="Say hi.", max_output_tokens=max_tokens, store=False
    )
    r = httpx.post(
        base_url + "/v1/messages",
        headers={"x-api-key": keys["anthropic"], "anthropic-version": "2023-06-01"},
        json={"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "Say hi."}]},
        timeout=120,
    )
    r.raise_for_status()
    r = httpx.post(
        f"{base_url}/v1beta/models/{model}:generateContent",
        headers={"x-goog-api-key": keys["gemini"]},
        json={
            "contents": [{"role": "user", "parts": [{"text": "Say hi."}]}],
            "generationConfig": {"maxOutputTokens": max_tokens},
        },
        timeout=120,
    )
    r.raise_for_status()


@click.command("demo")
@click.option(
    "--policy",
    "model",
    default=None,
    help="Model for the embedded engine (default: the offline tiny policy), as `polar run --policy`.",
)
@click.option("--model", "model_alias", default=None, hidden=True)  # its name before it matched `polar run`'s
@click.option(
    "--out",
    default="polar-demo",
    show_default=True,
    type=click.Path(path_type=Path),
    help="Folder for the SQLite store and the exported trajectories.",
)
@click.option("--turns", default=4, show_default=True, type=int, help="Turns of the agent loop.")
@click.option("--max-tokens", default=24, show_default=True, type=int, help="Tokens sampled per turn.")
@click.option(
    "--render",
    type=click.Choice(["gateway", "server"]),
    default="gateway",
    show_default=True,
    help="Who renders prompts: the gateway continues each session's token chain (one trace per session), "
    "the server re-renders the history at every call (as `polar gateway --render server`).",
)
@logging_options("warning")
def demo(
    model: str | None,
    model_alias: str | None,
    out: Path,
    turns: int,
    max_tokens: int,
    render: str,
    log_level: str,
    log_json: bool,
) -> None:
    """Run the quickstart: engine + gateway + SQLite, driven by a real SDK, then trajectories and audit.

    OUT/polar.db keeps the records of every demo run into OUT; OUT/trajectories.jsonl holds the trajectories
    of all of them.

    \b
    Examples:
      polar demo
      polar demo --out /tmp/demo --turns 8
      polar demo --policy Qwen/Qwen3-0.6B     # a real model (its weights must be on this machine)
      polar demo --render server              # the server renders: a random policy's turns drift apart
    """
    model = model or model_alias
    from polar.extras import ENGINE, require_cli

    require_cli(ENGINE)
    setup_logging(log_level, json=log_json)
    from polar.auth import bearer
    from polar.engine import Engine, create_engine_app
    from polar.gateway.app import create_app
    from polar.gateway.config import GatewayConfig
    from polar.serving import ServerThread
    from polar.store.sqlite import SQLiteStore
    from polar.trajectory import audit, build
    from polar.trajectory.export import rows, write_jsonl

    console = Console()
    out.mkdir(parents=True, exist_ok=True)
    store_path = out / "polar.db"
    servers: list[ServerThread] = []
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console
    )
    try:
        with progress:
            step = progress.add_task("loading the policy (builds the default model once)", total=None)
            engine = Engine.load(model, start=False)
            servers.append(ServerThread(create_engine_app(engine, manage_engine=True)).start())
            progress.update(
                step, total=1, completed=1, description=f"policy {engine.name} on {servers[0].url}"
            )
            step = progress.add_task("starting the gateway", total=None)
            config = GatewayConfig(
                backend_url=servers[0].url,
                served_model=engine.name,
                store_path=store_path,
                render=render,  # type: ignore[arg-type]
            )
            app = create_app(config)
            gateway = ServerThread(app.data, also=[app.control]).start()
            servers.append(gateway)
            progress.update(step, total=1, completed=1, description=f"gateway on {gateway.url}")
            control = httpx.Client(base_url=gateway.urls[1], headers=bearer(config.control_token))
            with control:  # sessions are made on the control listener; harnesses only see the model API
                keys = {
                    name: control.post("/sessions", json={"task_id": "demo", "harness": name}).json()[
                        "session_id"
                    ]
                    for name in ("chat", "responses", "anthropic", "gemini")
                }
            step = progress.add_task("agent loop (openai SDK, Chat)", total=turns)
            _agent_loop(
                gateway.url, keys["chat"], engine.name, turns, max_tokens, lambda: progress.advance(step)
            )
            step = progress.add_task("Responses, Anthropic and Gemini calls", total=1)
            _other_dialects(gateway.url, keys, engine.name, max_tokens)
            progress.update(step, completed=1)

        table = Table(title="captured sessions", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        # Headers short enough for an 80-column terminal (rich cuts a wider table's cells to "…").
        for col in ("dialect", "calls", "prompt ids", "sampled", "traces", "breaks", "coverage", "audit"):
            table.add_column(col, no_wrap=col not in ("breaks", "audit"))
        trajectories = []
        with SQLiteStore(store_path) as store:
            for name, key in keys.items():
                records = store.completions(key)
                merged = build(records, strategy="prefix_merging")
                flat = build(records, strategy="per_request")
                report = audit(merged, records)
                trajectories.append(merged)
                table.add_row(
                    name,
                    str(len(records)),
                    str(sum(len(r.prompt_ids or []) for r in records)),
                    str(sum(len(r.response_ids or []) for r in records)),
                    f"{len(flat.traces)} / {len(merged.traces)}",
                    ", ".join(
                        f"{k.removeprefix('context_').replace('_', ' ')} {v}"
                        for k, v in merged.metadata["breaks"].items()
                    )
                    or "-",
                    f"{merged.metadata['coverage']:.3f}",
                    "ok" if report.ok else "; ".join(report.errors),
                )
        console.print(table)
        # Every demo session the store holds, earlier runs' too: polar.db keeps them all, so the file does.
        with SQLiteStore(store_path) as store:
            every = [s.session_id for s in store.sessions(task_id="demo")]
            earlier = [
                build(store.completions(sid), strategy="prefix_merging")
                for sid in every
                if sid not in keys.values()
            ]
        jsonl = out / "trajectories.jsonl"
        write_jsonl((row for t in [*earlier, *trajectories] for row in rows(t, task_id="demo")), jsonl)
        why = (
            "The gateway rendered every prompt itself (--render gateway): each next prompt is the last one, "
            "the ids the policy sampled and the new messages, so a multi-turn session is one trace."
            if render == "gateway"
            else "The server re-rendered each history (--render server); the default policy is random, so its "
            "turns often re-tokenize differently in the next prompt (context drift): the chain is split "
            "there, never merged over a context the policy did not see."
        )
        console.print(
            "traces: per_request / prefix_merging, the traces a trainer gets; breaks: where a merged chain was "
            f"split. {why}"
        )
        runs = f" ({len(every)} sessions, {len(earlier)} of them from earlier demos)" if earlier else ""
        # Not wrapped at the terminal's width: a command is copied whole.
        console.print(f"store: {store_path}   trajectories: {jsonl}{runs}", soft_wrap=True)
        console.print(
            f"inspect: {polar_command()} traces show --store {store_path} --task demo", soft_wrap=True
        )
    finally:
        for srv in reversed(servers):
            srv.stop()
