"""`polar gateway`: serve the capturing gateway."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from polar.cli.common import build_gateway_config, gateway_options, log_level_option, setup_logging


@click.command("gateway")
@gateway_options(
    port=8100,
    control_token_help="Require this Bearer token on /sessions and /admin routes (env POLAR_CONTROL_TOKEN).",
)
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
@log_level_option
def gateway(
    backend_url: str,
    backend_kind: str,
    served_model: str | None,
    host: str,
    port: int,
    store_path: Path,
    durability: str,
    control_token: str | None,
    max_body_mb: int,
    timeout_s: float,
    retries: int,
    max_connections: int,
    log_level: str,
) -> None:
    """Serve the gateway in front of an inference server.

    Create a session with `POST /sessions`, give its `session_id` to a harness as its API key and point the
    harness's base URL here. Every call is forwarded to the backend and recorded with its token ids and
    logprobs; read them at `GET /sessions/{id}/completions`.

    \b
    Example:
      polar gateway --backend http://127.0.0.1:8000 --model Qwen/Qwen3-0.6B --port 8100
      curl -s -X POST localhost:8100/sessions -d '{"task_id": "t1"}'
    """
    import uvicorn

    from polar.gateway.app import create_app
    from polar.gateway.backends.base import BackendOptions
    from polar.http_server import http_protocol

    setup_logging(log_level)
    config = build_gateway_config(
        backend_url=backend_url,
        backend_kind=backend_kind,
        served_model=served_model,
        host=host,
        port=port,
        store_path=store_path,
        control_token=control_token,
        durability=durability,
        max_body_bytes=max_body_mb << 20,
        backend=BackendOptions(timeout_s=timeout_s, retries=retries, max_connections=max_connections),
    )
    logging.getLogger("polar").info("store: %s", store_path.resolve())
    # No proxy-headers middleware: nothing sits in front of a gateway, and it costs time on every call.
    uvicorn.run(
        create_app(config),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        proxy_headers=False,
        http=http_protocol(),
    )
