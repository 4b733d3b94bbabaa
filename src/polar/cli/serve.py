"""`polar serve`: the rollout server."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from polar.cli.common import (
    allow_callback_option,
    allow_plugins,
    dashboard_options,
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
    "--callback-attempts", default=8, show_default=True, type=int, help="Tries per trainer callback."
)
@plugin_option
@allow_callback_option
@token_file_option
@tokenizer_option
@train_dir_option
@log_level_option
def serve(
    host: str,
    port: int,
    db_path: Path,
    public_url: str | None,
    heartbeat_timeout_s: float,
    node_lost_after_s: float,
    callback_attempts: int,
    plugins: tuple[str, ...],
    allow_callback: tuple[str, ...],
    token_file: Path | None,
    tokenizer: str | None,
    train_dir: Path | None,
    log_level: str,
    log_json: bool,
) -> None:
    """Serve the rollout server: trainers submit tasks, gateway nodes run their sessions.

    Each task expands into `num_samples` sessions, placed on the least-loaded healthy node. Finished
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
    """
    from polar.rollout.server import ServerConfig, create_app
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
    if node_lost_after_s < heartbeat_timeout_s:
        raise click.BadParameter("must be at least --heartbeat-timeout", param_hint="--node-lost-after")
    if callback_attempts < 1:
        raise click.BadParameter("must be at least 1", param_hint="--callback-attempts")
    config = ServerConfig(
        db_path=db_path,
        public_url=public_url.rstrip("/") if public_url else None,
        heartbeat_timeout_s=heartbeat_timeout_s,
        node_lost_after_s=node_lost_after_s,
        callbacks=RetryPolicy(attempts=callback_attempts),
        token=resolve_token(token_file, create=True),
        outbound=outbound_policy(allow_callback),
    )
    # An open `GET /events` stream would otherwise hold uvicorn's graceful shutdown forever.
    server = EmbeddedServer(
        create_app(config, dashboard),
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
    serve_until_stopped([server], started=started, database=db_path)
