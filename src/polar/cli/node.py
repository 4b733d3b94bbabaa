"""`polar node`: a gateway node (the capturing gateway plus the staged session pools); `polar node drain`:
take one out of service gracefully."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

import click

from polar.cli.common import (
    allow_plugins,
    build_gateway_config,
    cannot_start,
    command_name,
    gateway_options,
    log_level_option,
    plugin_option,
    resolve_token,
    setup_logging,
    start_servers,
    token_file_option,
)
from polar.cli.submit import SERVER
from polar.runtime.factory import BACKENDS


@click.command("drain")
@click.argument("node_id")
@click.option("--server", default=SERVER, show_default=True, envvar="POLAR_SERVER", metavar="URL")
@token_file_option
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    help="Cancel sessions still running after this many seconds (default: let them finish).",
)
@click.option(
    "--reason", default="node drained (polar node drain)", show_default=True, help="Logged and recorded."
)
@click.option("--wait/--no-wait", default=True, show_default=True, help="Stay until the node has left.")
def drain(
    node_id: str, server: str, token_file: Path | None, timeout_s: float | None, reason: str, wait: bool
) -> None:
    """Drain NODE_ID: it takes no new session, hands the sessions whose agent has not started back to the
    server (which runs them on other nodes, same ids), lets running ones finish and report, then
    deregisters and its `polar node` process exits. For rolling upgrades and for freeing a machine.

    \b
    Examples:
      polar node drain node-gpu3                        # the server at $POLAR_SERVER (or --server)
      polar node drain node-gpu3 --timeout 900          # cancel what still runs after 15 minutes
      polar node drain node-gpu3 --no-wait              # ask, and return at once
      for n in node-a node-b; do polar node drain $n && restart-node $n; done   # one node at a time
    """
    from polar.client import RolloutClient, RolloutError

    token = resolve_token(token_file, create=False)

    async def go() -> None:
        async with RolloutClient(server, token=token, retry_window_s=5) as client:
            answer = await client.drain_node(node_id, timeout_s=timeout_s, reason=reason)
            click.echo(f"node {node_id}: draining ({_stages(answer.get('status') or {})})", err=True)
            last = ""
            while wait:
                mine = [n for n in await client.nodes() if n["node_id"] == node_id]
                if not mine:
                    click.echo(f"node {node_id}: left", err=True)
                    return
                line = _stages(mine[0].get("status") or {})
                if line != last:
                    click.echo(f"node {node_id}: draining ({line})", err=True)
                    last = line
                await asyncio.sleep(1.0)

    try:
        asyncio.run(go())
    except RolloutError as exc:
        raise click.ClickException(f"{server}: {exc}") from None


def _stages(status: dict[str, Any]) -> str:
    by_stage = status.get("by_stage") or {}
    if not by_stage:
        return "no sessions left"
    return ", ".join(f"{n} {stage}" for stage, n in sorted(by_stage.items()))


class _NodeCommand(click.Command):
    """`polar node [OPTIONS]` serves a node; `polar node drain ...` is its own command under the same name
    (a click group would make the serving options, `--backend` required among them, apply to `drain`)."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        if args[:1] == ["drain"]:
            return drain.make_context(f"{info_name} drain", args[1:], parent=parent, **extra)
        return super().make_context(info_name, args, parent=parent, **extra)


@click.command("node", cls=_NodeCommand)
@click.option(
    "--server", "server_url", metavar="URL", help="Rollout server to register with (omit: standalone)."
)
@gateway_options(port=8200)
@click.option(
    "--advertise-url",
    metavar="URL",
    help="How the server reaches this node's control listener (default: control host:port).",
)
@click.option(
    "--runtime-gateway-url", metavar="URL", help="The gateway as runtimes reach it (default: the node's URL)."
)
@click.option("--node-id", help="Name the server knows this node by (default: node-<hostname>).")
@click.option("--capacity", default=8, show_default=True, type=int, help="Sessions admitted at once.")
@click.option("--init-workers", default=4, show_default=True, type=int, help="Runtimes prepared at once.")
@click.option("--run-workers", default=8, show_default=True, type=int, help="Agents running at once.")
@click.option("--post-workers", default=4, show_default=True, type=int, help="Evaluations at once.")
@click.option(
    "--gateway-workers",
    default=1,
    show_default=True,
    type=int,
    help="Processes serving the gateway (`polar gateway --workers`): each session is served by one of "
    "them and its runtime pointed at it. 1: in the node's own process.",
)
@click.option(
    "--ready-buffer", default=4, show_default=True, type=int, help="Prepared runtimes kept waiting."
)
@click.option(
    "--runtime-root",
    type=click.Path(path_type=Path),
    help="Where session directories are made (default: the system temp dir).",
)
@click.option(
    "--keep",
    type=click.Choice(["nothing", "artifacts", "all"]),
    default="nothing",
    show_default=True,
    help="What of a session's directory survives it (artifacts: the harness's logs and transcripts).",
)
@plugin_option
@click.option(
    "--upload-root",
    "upload_roots",
    multiple=True,
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    help="A directory upload prepare actions may copy from (repeatable; default: none).",
)
@click.option(
    "--allow-runtime",
    "allow_runtimes",
    multiple=True,
    type=click.Choice(BACKENDS),
    help="A runtime backend tasks may use here (repeatable; default: any this machine runs). "
    "Leave out `local` when submitters are not trusted with this machine's files.",
)
@click.option(
    "--allow-network",
    "allow_networks",
    multiple=True,
    type=click.Choice(["gateway", "none", "host"]),
    help="A runtime network tasks may use here (repeatable; default: any). Leave out `host` to keep "
    "agents off this machine's network.",
)
@click.option(
    "--sandbox-path",
    "sandbox_paths",
    multiple=True,
    type=click.Path(path_type=Path, exists=True),
    help="A host path every sandbox here sees read-only, besides what its task names (a toolchain, "
    "datasets; repeatable). Never a store or token.",
)
@click.option("--heartbeat", "heartbeat_s", default=5.0, show_default=True, type=float, help="Seconds.")
@click.option(
    "--report-images/--no-report-images",
    default=True,
    show_default=True,
    help="Tell the server which docker/podman images this node holds and pull the images of queued sessions "
    "it asks for, so sessions go where their image is (docs/nodes.md, Placement).",
)
@log_level_option
def node(
    server_url: str | None,
    backend_urls: tuple[str, ...],
    backend_kind: str,
    served_model: str | None,
    host: str,
    port: int,
    advertise_url: str | None,
    runtime_gateway_url: str | None,
    node_id: str | None,
    capacity: int,
    init_workers: int,
    run_workers: int,
    post_workers: int,
    gateway_workers: int,
    ready_buffer: int,
    store_path: Path,
    control_host: str,
    control_port: int,
    token_file: Path | None,
    render: str,
    tokenizer: str | None,
    runtime_root: Path | None,
    keep: str,
    plugins: tuple[str, ...],
    allow_callback: tuple[str, ...],
    upload_roots: tuple[Path, ...],
    allow_runtimes: tuple[str, ...],
    allow_networks: tuple[str, ...],
    sandbox_paths: tuple[Path, ...],
    heartbeat_s: float,
    report_images: bool,
    log_level: str,
    log_json: bool,
) -> None:
    """Serve a gateway node: harnesses call its gateway, the rollout server dispatches sessions to it.

    Each session goes INIT (runtime, prepare steps, harness setup) -> READY -> RUNNING (the harness) ->
    POSTRUN (trajectory, evaluation, rewards), each stage with its own worker pool. Harnesses reach only
    the model API (--port); the server talks to the control listener (--control-port) with the shared
    control token, which must be the server's (POLAR_TOKEN, --token-file or ~/.config/polar/token).

    \b
    Example:
      polar node --server http://127.0.0.1:8300 --backend http://127.0.0.1:8000 --port 8200
      # on another machine than the server: a control listener the server can reach
      POLAR_TOKEN=... polar node --server http://head:8300 --backend http://gpu:8000 --control-host 0.0.0.0
      polar node drain node-gpu3    # take a node out gracefully (see `polar node drain --help`)
      # submitters you do not trust with this machine: sandboxes only, no host network
      polar node --server http://head:8300 --backend http://gpu:8000 --allow-runtime bwrap \
          --allow-runtime docker --allow-network gateway --allow-network none
      # many agents with long contexts: the gateway on 4 cores
      polar node --server http://head:8300 --backend http://gpu:8000 --gateway-workers 4

    A node restarted with the same --store and --node-id reports the outcomes its predecessor had not
    delivered (sessions that were running end ERROR "node restarted"; none runs twice).
    """
    from polar.rollout.node import Node, NodeConfig
    from polar.rollout.node.gateway_link import GatewayStartError

    setup_logging(log_level, json=log_json)
    allow_plugins(plugins)
    try:
        gateway = build_gateway_config(
            backend_urls=backend_urls,
            backend_kind=backend_kind,
            served_model=served_model,
            host=host,
            port=port,
            store_path=store_path,
            control_token=resolve_token(token_file, create=True),
            control_host=control_host,
            control_port=control_port,
            allow_callback=allow_callback,
            render=render,
            tokenizer=tokenizer,
        )
        extra = {"node_id": node_id} if node_id else {}
        config = NodeConfig(
            gateway=gateway,
            capacity=capacity,
            init_workers=init_workers,
            run_workers=run_workers,
            post_workers=post_workers,
            ready_buffer=ready_buffer,
            gateway_workers=gateway_workers,
            server_url=server_url,
            advertise_url=advertise_url,
            runtime_gateway_url=runtime_gateway_url,
            runtime_root=runtime_root,
            keep=keep,  # type: ignore[arg-type]
            upload_roots=tuple(root.resolve() for root in upload_roots),
            allowed_runtimes=allow_runtimes or None,
            allowed_networks=allow_networks or None,
            sandbox_paths=tuple(path.resolve() for path in sandbox_paths),
            heartbeat_s=heartbeat_s,
            report_images=report_images,
            **extra,  # type: ignore[arg-type]
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None

    command = command_name()

    async def serve() -> None:
        n = Node(config)
        # Both ports bound first; a port in use or a failed start (no --model and the backend unreachable):
        # one line, exit status 2.
        try:
            await start_servers(n.start(), command, store_path)
        except GatewayStartError as exc:  # the workers' own one line
            raise cannot_start(str(exc), command) from None
        from polar.memory import tune_gc

        tune_gc()  # a process of its own, serving calls from now on
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task[None]] = []

        def on_signal() -> None:
            # Sessions end (CANCELLED, runtimes freed, results reported) before the gateway goes away.
            if not stopping:
                stopping.append(loop.create_task(n.stop()))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        if not log_json:  # JSON logs carry the same in the node's own start record
            click.echo(
                f"polar node {n.node_id}: model API at {n.url}, control at {n.control_url} "
                f"(store {store_path.resolve()})",
                err=True,
            )
        await n.serve_forever()
        logging.getLogger("polar.node").info("node stopped")

    asyncio.run(serve())
