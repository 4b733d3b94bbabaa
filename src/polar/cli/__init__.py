"""The `polar` command. Each subcommand lives in its own module and is imported only when used, so
`polar --help` stays fast and a missing optional dependency (torch for the engine) only affects its command.

A user's mistake (a bad file, option or setting; a server that cannot start) is one message without a
traceback (`click.ClickException`). Anything else escaping a command is a bug in polar: a short traceback
and one line asking to report it (`_report_bug`).

Every command exits with one of these statuses (docs/cli.md, "Exit status"), so scripts and schedulers can
tell a bug from a mistake from work that ran and partly failed.
"""

from __future__ import annotations

import errno
import importlib
import traceback
from typing import IO, Any, NoReturn

import click

OK = 0
BUG = 1  # an internal error: a traceback and a request to report it
USER_ERROR = 2  # bad input, options or settings; a missing extra; something the command needs is not there
FAILURES = 3  # the command ran, but part of its work failed (sessions, image builds, audits): it says which
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), after keeping what finished; SIGTERM: 143 (`polar.interrupt`)

# Frames of a bug's traceback shown (the innermost ones: where it went wrong, not how click got there).
BUG_FRAMES = 8

# name -> (module, attribute, one-line help). Keep alphabetical.
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "dashboard": (
        "polar.cli.dashboard",
        "dashboard",
        "Serve the dashboard's training curves for a `polar train` out folder.",
    ),
    "demo": ("polar.cli.demo", "demo", "Run the quickstart: gateway + policy, driven by real SDK clients."),
    "gateway": (
        "polar.cli.gateway",
        "gateway",
        "Serve the capturing gateway in front of an inference server.",
    ),
    "generate": (
        "polar.cli.generate",
        "generate",
        "Run a task file and keep the sessions that pass a filter as SFT/RL training data.",
    ),
    "images": ("polar.cli.images", "images", "Build container images locally (no registry needed)."),
    "node": (
        "polar.cli.node",
        "node",
        "Serve a gateway node: the gateway plus staged session pools (INIT, RUN, POSTRUN).",
    ),
    "replay": ("polar.cli.replay", "replay", "Serve a recorded session back as an inference server."),
    "run": ("polar.cli.run", "run", "Run a task file end to end here: server, node and embedded engine."),
    "serve": (
        "polar.cli.serve",
        "serve",
        "Serve the rollout server: tasks, sessions, nodes, trainer callbacks.",
    ),
    "serve-model": ("polar.cli.serve_model", "serve_model", "Serve a policy with the embedded engine."),
    "status": ("polar.cli.status", "status", "Show the rollout server's tasks and nodes, or one task."),
    "submit": ("polar.cli.submit", "submit", "Submit a task file to the rollout server."),
    "traces": ("polar.cli.traces", "traces", "Build, audit and export trajectories from a store."),
    "train": (
        "polar.cli.train",
        "train",
        "Train a policy with GRPO over harness rollouts, as CONFIG (YAML) says.",
    ),
}


def _report(exc: BaseException, ctx: click.Context) -> NoReturn:
    """A server a command started in-process that could not start (`polar run` with its backend down, a
    port in use) is the user's problem in one line; anything else is a bug."""
    from polar.cli.common import start_failure
    from polar.serving import StartupError

    failure = start_failure(exc, f"polar {ctx.invoked_subcommand or ''}".strip())
    if failure is not None:
        failure.show()
        ctx.exit(failure.exit_code)
    _report_bug(exc.error if isinstance(exc, StartupError) else exc)
    ctx.exit(BUG)


def _report_bug(exc: BaseException) -> None:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-BUG_FRAMES)
    click.echo("".join(lines).rstrip(), err=True)
    click.echo(
        f"polar: internal error ({type(exc).__name__}): this is a bug in polar, not something you did. "
        "Please report it with the command you ran and the traceback above.",
        err=True,
    )


class _UserError(click.ClickException):
    """A `click.ClickException` raised with click's default status 1, shown as it was, with status 2."""

    exit_code = USER_ERROR

    def __init__(self, original: click.ClickException) -> None:
        super().__init__(original.message)
        self.original = original

    def show(self, file: IO[Any] | None = None) -> None:
        self.original.show(file)


class _LazyGroup(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except click.exceptions.ClickException as exc:
            # Status 1 is click's default for its exception; raised by a command, it is the user's mistake.
            if exc.exit_code == BUG:
                raise _UserError(exc) from None
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # output piped into `head`: click ends quietly
                raise
            _report(exc, ctx)
        except Exception as exc:  # not KeyboardInterrupt or SystemExit: those end the command as they mean
            _report(exc, ctx)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = _COMMANDS.get(cmd_name)
        if spec is None:
            return None
        module = importlib.import_module(spec[0])
        cmd = getattr(module, spec[1])
        assert isinstance(cmd, click.Command)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="polar-rl")
def main() -> None:
    """polar: train models inside the agent harnesses people use, without changing them.

    The gateway sits at the model API boundary of any harness (Codex, Claude Code, Gemini CLI, Qwen Code,
    OpenCode, Pi, or your own program), records the exact tokens and log-probabilities of every call, and
    turns them into trainer-ready trajectories.
    """
    from polar.edge import prepare_server_process

    prepare_server_process()  # before any command binds or spawns: the open-files limit, throttled logs
