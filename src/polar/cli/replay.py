"""`polar replay`: serve a recorded session back as an inference server."""

from __future__ import annotations

from pathlib import Path

import click

from polar.cli.common import log_level_option, setup_logging


@click.command("replay")
@click.argument("store", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("session_id")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@log_level_option
def replay(store: Path, session_id: str, host: str, port: int, log_level: str, log_json: bool) -> None:
    """Serve SESSION_ID, as STORE recorded it, as a vLLM-shaped inference server.

    Each request that is one of the session's recorded calls (the exact body the gateway sent upstream)
    gets the recorded answer: message, token ids, logprobs. Any other request is answered 409, naming the
    first message (or field) where it differs from the recording. Put a gateway in front of it and run the
    same harness on the same task: the run is reproduced offline, or a changed CLI shows where it departs.

    \b
    Examples:
      polar replay polar-run/gateway.db sess-1a2b --port 8100
      polar gateway --backend http://127.0.0.1:8100 --port 8200   # then run the harness against :8200
      polar run task.yaml --backend http://127.0.0.1:8100 --out replayed  # or the same task again
      polar traces show --store polar-run/gateway.db --stats-only   # to find a session id
    """
    from polar.cli.common import cannot_start, serve_until_stopped
    from polar.replay import Recording, RecordingError, create_replay_app
    from polar.serving import BindError, EmbeddedServer

    setup_logging(log_level, json=log_json)
    try:
        recording = Recording.load(store, session_id)
    except RecordingError as exc:
        raise cannot_start(str(exc)) from None
    server = EmbeddedServer(create_replay_app(recording), host, port, log_level=log_level.lower())
    try:
        server.bind()
    except BindError as exc:
        raise cannot_start(str(exc)) from None

    def started() -> None:
        click.echo(
            f"replaying {session_id} ({len(recording.records)} calls, model {', '.join(recording.models)}) "
            f"on {server.url}",
            err=True,
        )

    serve_until_stopped([server], started=started)
