"""`polar serve`: the rollout server."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from polar.cli.common import (
    BACKEND_HELP,
    allow_callback_option,
    allow_plugins,
    cannot_start,
    dashboard_options,
    expand_backends,
    host_port_options,
    log_level_option,
    outbound_policy,
    plugin_option,
    resolve_token,
    serve_until_stopped,
    setup_logging,
    token_file_option,
    tokenizer_option,
    train_dir_option,
)
from polar.cli.raycli import check_ray_options, ray_options

if TYPE_CHECKING:
    from polar.rollout.ray.spec import NodeRequest
    from polar.rollout.server import ServerConfig
    from polar.serving import EmbeddedServer


@click.command("serve")
@host_port_options(8300)
@click.option(
    "--db",
    "db_path",
    default="polar-server.db",
    show_default=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="SQLite file with tasks, sessions, nodes and pending callbacks (survives restarts).",
)
@click.option(
    "--public-url",
    metavar="URL",
    help="How nodes reach this server, for their result callbacks (default: the URL a node registered to).",
)
@click.option(
    "--heartbeat-timeout",
    "heartbeat_timeout_s",
    default=15.0,
    show_default=True,
    type=float,
    help="Seconds without a heartbeat before a node gets no new sessions.",
)
@click.option(
    "--node-lost-after",
    "node_lost_after_s",
    default=120.0,
    show_default=True,
    type=float,
    help="Seconds without any answer before a node is gone; its open sessions end as ERROR 'node lost'.",
)
@click.option(
    "--locality-wait",
    "locality_wait_s",
    default=60.0,
    show_default=True,
    type=float,
    help="Seconds a queued session may be passed over for a free slot where its container image is not, "
    "while a busy node holds it (about what an image pull costs; 0: never wait).",
)
@click.option(
    "--callback-attempts", default=8, show_default=True, type=int, help="Tries per trainer callback."
)
@plugin_option
@allow_callback_option
@token_file_option
@tokenizer_option
@train_dir_option
@ray_options(run=False)
@click.option(
    "--backend",
    "backend_urls",
    metavar="URL",
    multiple=True,
    callback=expand_backends,
    help=f"With --ray: the policy's inference server for the gateway nodes. {BACKEND_HELP}",
)
@click.option(
    "--backend-kind",
    type=click.Choice(["vllm", "sglang", "openai"]),
    default="vllm",
    show_default=True,
    help="With --ray: the inference servers' API.",
)
@click.option("--model", "served_model", help="With --ray: the served model name (default: what it lists).")
@click.option(
    "--capacity",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="With --ray: sessions each gateway node runs at once.",
)
@click.option(
    "--gateway-workers",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    metavar="N",
    help="With --ray: each gateway node serves its gateway on N processes beside its actor, one store "
    "(docs/gateway-workers.md); it asks Ray for at least N CPUs.",
)
@click.option(
    "--ray-store",
    type=click.Path(path_type=Path, file_okay=False),
    help="With --ray: each gateway node's store on its Ray node, DIR/<node id>/gateway.db "
    "(default: nodes/ beside --db).",
)
@log_level_option
def serve(
    host: str,
    port: int,
    db_path: Path,
    public_url: str | None,
    heartbeat_timeout_s: float,
    node_lost_after_s: float,
    locality_wait_s: float,
    callback_attempts: int,
    plugins: tuple[str, ...],
    allow_callback: tuple[str, ...],
    token_file: Path | None,
    tokenizer: str | None,
    train_dir: Path | None,
    ray_address: str | None,
    ray_resource: str | None,
    ray_cpus: float | None,
    ray_memory_mb: int | None,
    backend_urls: tuple[str, ...],
    backend_kind: str,
    served_model: str | None,
    capacity: int,
    gateway_workers: int,
    ray_store: Path | None,
    log_level: str,
    log_json: bool,
) -> None:
    """Serve the rollout server: trainers submit tasks, gateway nodes run their sessions.

    Each task expands into `num_samples` sessions, placed on a healthy node: where the session's container
    image is (nodes report theirs), its group's other samples run, and the least load. Finished
    results are kept in the database (a restart loses none and resumes unfinished tasks), posted to the
    task's `callback_url`, and readable at `GET /rollout/task/{id}`. Callback and side-call URLs must be
    public addresses unless `--allow-callback` names them. Every route but /health needs the control
    token (Authorization: Bearer): POLAR_TOKEN, --token-file, or ~/.config/polar/token, which is written on
    first start when none is set; nodes and `polar submit` on this machine then find it.

    The dashboard is served under /ui (same listener, same token): open the logged `dashboard:` URL and
    paste the control token once (see docs/dashboard.md). Bind --host to an address only operators reach: the control
    routes are there too.

    \b
    Examples:
      polar serve --port 8300 --db runs/server.db
      polar node --server http://127.0.0.1:8300 --backend http://127.0.0.1:8000
      polar submit examples/tasks.yaml --wait
      polar serve --train polar-train --tokenizer ./my-policy   # + training curves, token text
      polar serve --host 0.0.0.0 --ray --backend http://gpu1:8000 --backend http://gpu2:8000
      polar serve --host 0.0.0.0 --ray head:6379 --ray-resource polar --capacity 16 --backend @vllm.txt
      polar serve --host 0.0.0.0 --ray --capacity 256 --gateway-workers 4 --backend @vllm.txt

    With --ray, the server also starts a gateway node as a Ray actor on each Ray node offering what one
    takes (--ray-resource, --ray-cpus, --ray-memory), keeps one on every such node that joins, and ends
    the sessions of a Ray node that dies at once (ERROR, not re-run). HTTP nodes may join as well: one
    scheduler places on both (docs/deploy.md).
    """
    from polar.dashboard import server_app
    from polar.rollout.ray.spec import NodeRequest
    from polar.rollout.server import ServerConfig
    from polar.rollout.server.callbacks import RetryPolicy
    from polar.serving import EmbeddedServer

    setup_logging(log_level, json=log_json)
    allow_plugins(plugins)
    dashboard = dashboard_options(tokenizer, train_dir)
    if public_url is not None and not public_url.startswith(("http://", "https://")):
        raise click.BadParameter(f"must be an http(s) URL, not {public_url!r}", param_hint="--public-url")
    for name, value in (
        ("--heartbeat-timeout", heartbeat_timeout_s),
        ("--node-lost-after", node_lost_after_s),
    ):
        if value <= 0:
            raise click.BadParameter("must be positive", param_hint=name)
    if locality_wait_s < 0:
        raise click.BadParameter("must be 0 or more", param_hint="--locality-wait")
    if node_lost_after_s < heartbeat_timeout_s:
        raise click.BadParameter("must be at least --heartbeat-timeout", param_hint="--node-lost-after")
    if callback_attempts < 1:
        raise click.BadParameter("must be at least 1", param_hint="--callback-attempts")
    check_ray_options(ray_address, ray_resource, ray_cpus, ray_memory_mb)
    if ray_address is None:
        for name, given in (
            ("--backend", backend_urls),
            ("--model", served_model),
            ("--ray-store", ray_store),
            ("--gateway-workers", gateway_workers > 1),
        ):
            if given:
                raise click.BadParameter(
                    "needs --ray (gateway nodes elsewhere have their own)", param_hint=name
                )
    elif not backend_urls:
        raise click.BadParameter(
            "--ray needs the policy's inference server for its gateway nodes", param_hint="--backend"
        )
    config = ServerConfig(
        db_path=db_path,
        public_url=public_url.rstrip("/") if public_url else None,
        heartbeat_timeout_s=heartbeat_timeout_s,
        node_lost_after_s=node_lost_after_s,
        locality_wait_s=locality_wait_s,
        callbacks=RetryPolicy(attempts=callback_attempts),
        token=resolve_token(token_file, create=True),
        outbound=outbound_policy(allow_callback),
    )
    # An open `GET /events` stream would otherwise hold uvicorn's graceful shutdown forever.
    server = EmbeddedServer(
        server_app(config, dashboard),
        host,
        port,
        log_level=log_level,
        log_config=None,
        timeout_graceful_shutdown=3,
    )

    def started() -> None:
        log = logging.getLogger("polar")
        log.info("rollout server at %s (bearer token required); state: %s", server.url, db_path.resolve())
        # A server's output ends up in log collectors: the link carries no token here (`polar run`'s, on
        # an operator's own terminal, does); the login page takes the token pasted once.
        log.info(
            "dashboard: %s/ui/ (log in with the control token: POLAR_TOKEN, --token-file or "
            "~/.config/polar/token)",
            server.url.rstrip("/"),
        )

    # The port is bound before the server opens its database; a port in use, a database that cannot be
    # opened: one line, exit status 2.
    attach = None
    if ray_address is not None:
        try:
            # No task file here: the CPUs default to the node's own (one per gateway worker), as in `polar run`.
            request = NodeRequest.for_tasks(
                (), capacity, resource=ray_resource, cpus=ray_cpus, memory_mb=ray_memory_mb,
                gateway_workers=gateway_workers,
            )  # fmt: skip
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--ray-resource") from None
        attach = _ray_gateways(
            config, server, ray_address or None, request,
            backend_urls=backend_urls, backend_kind=backend_kind, served_model=served_model, capacity=capacity,
            gateway_workers=gateway_workers, store_dir=(ray_store or db_path.resolve().parent / "nodes").resolve(), plugins=plugins,
            allow_callback=allow_callback, log_level=log_level,
        )  # fmt: skip
    serve_until_stopped([server], started=started, database=db_path, attach=attach)


def _ray_gateways(
    config: ServerConfig,
    server: EmbeddedServer,
    address: str | None,
    request: NodeRequest,
    *,
    backend_urls: tuple[str, ...],
    backend_kind: str,
    served_model: str | None,
    capacity: int,
    gateway_workers: int,
    store_dir: Path,
    plugins: tuple[str, ...],
    allow_callback: tuple[str, ...],
    log_level: str,
) -> Callable[[], contextlib.AbstractAsyncContextManager[None]]:
    """`--ray`: gateway actors on the Ray nodes, started once the server serves, stopped before it stops."""
    from polar.cli.common import build_gateway_config
    from polar.rollout.node import NodeConfig
    from polar.rollout.ray.cluster import RayError, RayNodes, connect, disconnect
    from polar.rollout.ray.spec import RayNodeSpec

    gateway = build_gateway_config(
        backend_urls=backend_urls, backend_kind=backend_kind, served_model=served_model, host="127.0.0.1",
        port=0, store_path=store_dir / "gateway.db", control_token=config.token, control_host="127.0.0.1",
        control_port=0, allow_callback=allow_callback,
    )  # fmt: skip

    @contextlib.asynccontextmanager
    async def attach() -> AsyncIterator[None]:
        server_url = config.public_url or server.public_url
        node = NodeConfig(
            gateway=gateway,
            capacity=capacity,
            run_workers=capacity,
            server_url=server_url,
            report_images=True,
            gateway_workers=gateway_workers,
        )
        spec = RayNodeSpec(config=node, store_dir=store_dir, log_level=log_level, plugins=plugins)
        try:
            connected = connect(address, log_to_driver=True)
        except RayError as exc:
            raise cannot_start(str(exc)) from None
        nodes = RayNodes(spec, request, server_url, config.token)
        try:
            await nodes.start(wait_for_one=False)
            yield
        except RayError as exc:
            raise cannot_start(str(exc)) from None
        finally:
            await nodes.stop("the rollout server stopped")
            if connected:
                disconnect()

    return attach
