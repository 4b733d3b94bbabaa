"""`polar gateway`: serve the capturing gateway."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click

from polar.cli.common import (
    build_gateway_config,
    gateway_options,
    log_level_option,
    resolve_token,
    serve_until_stopped,
    setup_logging,
)


@click.command("gateway")
@gateway_options(port=8100)
@click.option(
    "--durability",
    type=click.Choice(["normal", "full"]),
    default="normal",
    show_default=True,
    help="normal survives a killed process; full also survives power loss (fsync per commit).",
)
@click.option("--max-body-mb", default=32, show_default=True, type=int, help="Refuse larger bodies with 413.")
@click.option(
    "--timeout",
    "timeout_s",
    default=600.0,
    show_default=True,
    type=float,
    help="Upstream timeout per call, seconds.",
)
@click.option(
    "--retries",
    default=2,
    show_default=True,
    type=int,
    help="Upstream retries on refused connections and 502/503/504.",
)
@click.option(
    "--max-connections", default=512, show_default=True, type=int, help="Upstream connection pool size."
)
@click.option(
    "--workers",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    help="Serving processes over the one store (a core each); each session is served by one of them. "
    "Sessions created on the control listener are given their worker's own model API as base_url; calls "
    "on the shared --port are passed to the session's worker (docs/gateway-workers.md).",
)
@log_level_option
def gateway(
    backend_urls: tuple[str, ...],
    backend_kind: str,
    served_model: str | None,
    host: str,
    port: int,
    store_path: Path,
    durability: str,
    control_host: str,
    control_port: int,
    token_file: Path | None,
    allow_callback: tuple[str, ...],
    render: str,
    tokenizer: str | None,
    max_body_mb: int,
    timeout_s: float,
    retries: int,
    max_connections: int,
    workers: int,
    log_level: str,
    log_json: bool,
) -> None:
    """Serve the gateway in front of an inference server, on two listeners.

    The model API (--host/--port) is what harnesses call: the four dialects, model listing, probes. The
    control listener (--control-host/--control-port, loopback) holds sessions, records, trajectories and
    pause/resume, and needs the control token (Authorization: Bearer). Create a session there, give its
    `session_id` to a harness as its API key and point the harness's base URL at the model API. Every call
    is forwarded to the backend and recorded with its token ids and logprobs.

    \b
    Example:
      polar gateway --backend http://127.0.0.1:8000 --model Qwen/Qwen3-0.6B --port 8100
      polar gateway --backend http://gpu0:8000 --backend http://gpu1:8000   # several servers, one model
      polar gateway --backend http://127.0.0.1:8000 --render gateway   # token-in: one chain per session
      polar gateway --backend http://127.0.0.1:8000 --workers 4   # four processes, sessions spread over them
      TOKEN=$(cat ~/.config/polar/token)
      curl -s -H "Authorization: Bearer $TOKEN" -X POST localhost:8101/sessions -d '{"task_id": "t1"}'
      curl -s -H "Authorization: Bearer $TOKEN" localhost:8101/sessions/SESSION_ID/completions
    """
    from polar.gateway.app import create_app
    from polar.gateway.backends.base import BackendOptions
    from polar.harness.registry import classifier
    from polar.serving import EmbeddedServer

    setup_logging(log_level, json=log_json)
    config = build_gateway_config(
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
        durability=durability,
        max_body_bytes=max_body_mb << 20,
        backend=BackendOptions(timeout_s=timeout_s, retries=retries, max_connections=max_connections),
    )
    # No proxy-headers middleware: nothing sits in front of a gateway, and it costs time on every call.
    options: dict[str, Any] = {"log_level": log_level, "proxy_headers": False}
    if workers > 1:
        from polar.cli.workers import serve_workers
        from polar.memory import tune_gc

        logging.getLogger("polar.gateway").info("store: %s", store_path.resolve())
        serve_workers(config, workers, classifier, options, on_worker_start=tune_gc)
        return
    app = create_app(config, classifier)
    servers = [
        EmbeddedServer(app.data, host, port, **options),
        EmbeddedServer(
            app.control, control_host, control_port, lifespan="off", label="control port", **options
        ),
    ]

    def started() -> None:
        from polar.memory import tune_gc

        tune_gc()  # a process of its own, serving calls from now on
        log = logging.getLogger("polar.gateway")
        log.info("store: %s", store_path.resolve())
        log.info("model API at %s, control at %s (bearer token required)", servers[0].url, servers[1].url)

    # Both ports are bound before the gateway starts; a port in use, a backend that cannot be reached
    # without --model, a store that cannot be opened: one line, exit status 2.
    serve_until_stopped(servers, started=started, database=store_path)
