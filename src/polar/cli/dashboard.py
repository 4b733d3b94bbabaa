"""`polar dashboard RUN_DIR`: the dashboard of a run that has ended (or of a `polar train` out folder)."""

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
@click.argument("run_dir", required=False, type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option(
    "--train",
    "train_dir",
    metavar="OUT",
    type=click.Path(path_type=Path, exists=True),
    help="A `polar train` out folder (or its metrics.jsonl); the page follows it while it trains.",
)
@host_port_options(8310)
@tokenizer_option
@token_file_option
@log_level_option
def dashboard(
    run_dir: Path | None,
    train_dir: Path | None,
    host: str,
    port: int,
    tokenizer: str | None,
    token_file: Path | None,
    log_level: str,
    log_json: bool,
) -> None:
    """Serve the dashboard of RUN_DIR, the --out of a `polar run`, `generate` or `train` that has ended:
    its tasks and sessions, each session's conversation, records, trajectory and token view, read from the
    folder's server.db and gateway.db (a run's own `dashboard:` link ends with the run). A training folder
    also gets its curves (from metrics.jsonl), as --train OUT alone does.

    Open the printed URL: it logs the browser in with the control token (POLAR_TOKEN, --token-file, or
    ~/.config/polar/token), carried after `#`, which the browser never sends anywhere. The folder is only
    read: a run resumed into it meanwhile shows on the next page load.

    \b
    Examples:
      polar dashboard polar-run                     # a finished (or interrupted) polar run
      polar dashboard polar-train                   # a training run: sessions and curves
      polar dashboard --train runs/exp1/metrics.jsonl --port 8311
    """
    from polar.dashboard import Dashboard, dashboard_url
    from polar.dashboard.finished import FinishedRun, NotARun
    from polar.serving import EmbeddedServer

    if run_dir is None and train_dir is None:
        raise click.UsageError("give a run folder (RUN_DIR), or --train OUT")
    setup_logging(log_level, json=log_json)
    if train_dir is None and run_dir is not None and (run_dir / "metrics.jsonl").is_file():
        train_dir = run_dir
    run = None
    if run_dir is not None:
        try:
            run = FinishedRun(run_dir)
        except NotARun as exc:
            if train_dir is None:
                raise click.BadParameter(str(exc), param_hint="RUN_DIR") from None
    options = dashboard_options(tokenizer, train_dir)
    token = resolve_token(token_file, create=True)
    app = Dashboard(token, options, lambda: run, records=run.records if run is not None else None)
    server = EmbeddedServer(
        app, host, port, log_level=log_level, log_config=None, timeout_graceful_shutdown=3
    )

    def started() -> None:
        page = "" if run is not None else "training"
        click.echo(f"dashboard: {dashboard_url(server.url, token, page)}", err=True)

    try:
        serve_until_stopped([server], started=started)
    finally:
        if run is not None:
            run.close()
