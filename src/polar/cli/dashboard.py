"""`polar dashboard --train OUT`: the dashboard's training page on its own, for a `polar train` run."""

from __future__ import annotations

from pathlib import Path

import click

from polar.cli.common import (
    dashboard_options,
    host_port_options,
    log_level_option,
    resolve_token,
    serve_until_stopped,
    setup_logging,
    token_file_option,
    tokenizer_option,
)


@click.command("dashboard")
@click.option(
    "--train",
    "train_dir",
    metavar="OUT",
    required=True,
    type=click.Path(path_type=Path, exists=True),
    help="A `polar train` out folder (or its metrics.jsonl); the page follows it while it trains.",
)
@host_port_options(8310)
@tokenizer_option
@token_file_option
@log_level_option
def dashboard(
    train_dir: Path,
    host: str,
    port: int,
    tokenizer: str | None,
    token_file: Path | None,
    log_level: str,
    log_json: bool,
) -> None:
    """Serve the dashboard's training page for a `polar train` out folder: reward, pass rate, staleness
    drops, tokens per step and policy version, read from OUT/metrics.jsonl.

    The live rollout views (tasks, sessions, token view, cancel) are on the rollout server itself: the
    `dashboard:` URL that `polar run` and `polar serve` print (`polar serve --train OUT` shows both).
    Open the printed URL: it logs the browser in with the control token (POLAR_TOKEN, --token-file, or
    ~/.config/polar/token), carried after `#`, which the browser never sends anywhere.

    \b
    Examples:
      polar dashboard --train polar-train
      polar dashboard --train runs/exp1/metrics.jsonl --port 8311
    """
    from polar.dashboard import Dashboard, dashboard_url
    from polar.serving import EmbeddedServer

    setup_logging(log_level, json=log_json)
    options = dashboard_options(tokenizer, train_dir)
    token = resolve_token(token_file, create=True)
    app = Dashboard(token, options, lambda: None)
    server = EmbeddedServer(
        app, host, port, log_level=log_level, log_config=None, timeout_graceful_shutdown=3
    )

    def started() -> None:
        click.echo(f"dashboard: {dashboard_url(server.url, token, 'training')}", err=True)

    serve_until_stopped([server], started=started)
