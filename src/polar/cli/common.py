"""Helpers shared by CLI commands: logging, the options every command that serves a gateway takes, and
starting servers that either start or say why in one line (`CannotStart`, `serve_until_stopped`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from polar.dashboard.app import DashboardOptions
    from polar.gateway.config import GatewayConfig
    from polar.netguard import OutboundPolicy
    from polar.serving import EmbeddedServer

# Every command sets up logging from here; the setup itself lives below the CLI, where nodes started as
# Ray actors reach it too.
from polar.logs import setup_logging as setup_logging

F = TypeVar("F", bound=Callable[..., Any])


def _apply(f: F, options: list[Callable[[F], F]]) -> F:
    # click lists options in the order their decorators are written, i.e. applied last to first
    for option in reversed(options):
        f = option(f)
    return f


def logging_options(default: str = "info") -> Callable[[F], F]:
    """`--log-level` (passed to `setup_logging` and uvicorn) and `--log-json`, for every command that logs.
    Commands whose own output is the point (`polar run`, `train`) default to warning."""

    def decorate(f: F) -> F:
        return _apply(
            f,
            [
                click.option(
                    "--log-level",
                    default=default,
                    show_default=True,
                    type=click.Choice(["debug", "info", "warning", "error"]),
                    help="Least severe log records shown (on stderr).",
                ),
                click.option(
                    "--log-json",
                    is_flag=True,
                    help="Log one JSON object per line (time, level, logger, message) instead of text.",
                ),
            ],
        )

    return decorate


def log_level_option(f: F) -> F:
    """`logging_options()` with the servers' default, info."""
    return logging_options()(f)


def allow_callback_option(f: F) -> F:
    """`--allow-callback`, repeatable: where task-given URLs (callbacks, side-call and judge backends) may
    point beyond public addresses (see `polar.netguard`)."""
    return click.option(
        "--allow-callback",
        "allow_callback",
        multiple=True,
        metavar="HOST_OR_CIDR",
        help="Let task callback, side-call and judge backend URLs reach this IP, CIDR or host name although "
        "it is not a public address (e.g. 127.0.0.1, 10.0.0.0/8, trainer.internal); repeatable. Link-local "
        "and cloud metadata addresses stay refused.",
    )(f)


def outbound_policy(allow_callback: tuple[str, ...], hint: str = "--allow-callback") -> OutboundPolicy:
    """The `OutboundPolicy` of `--allow-callback` entries; a bad entry is a usage error."""
    from polar.netguard import OutboundPolicy

    try:
        return OutboundPolicy(allow=tuple(allow_callback))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


def host_port_options(port: int) -> Callable[[F], F]:
    """`--host` (loopback by default) and `--port` with this command's default."""

    def decorate(f: F) -> F:
        return _apply(
            f,
            [
                click.option("--host", default="127.0.0.1", show_default=True),
                click.option("--port", default=port, show_default=True, type=int),
            ],
        )

    return decorate


def token_file_option(f: F) -> F:
    """`--token-file`: where the deployment's control token is (see `polar.auth`)."""
    return click.option(
        "--token-file",
        type=click.Path(path_type=Path, dir_okay=False),
        envvar="POLAR_TOKEN_FILE",
        help="File holding the control token (default: $POLAR_TOKEN, else ~/.config/polar/token).",
    )(f)


class CannotStart(click.ClickException):
    """A server that cannot start: one line on stderr naming the problem (`polar gateway: port 8100 on
    127.0.0.1 is in use (another polar gateway?)`), exit status 2, no traceback."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(self.format_message(), err=True)


def command_name() -> str:
    """`polar gateway` for the command running now."""
    ctx = click.get_current_context(silent=True)
    return f"polar {ctx.info_name}" if ctx is not None and ctx.info_name else "polar"


def polar_command() -> str:
    """How to run polar again from the shell this process came from, for the commands a run prints:
    `polar` when that is on PATH, else the path it was started by (`.venv/bin/polar` after scripts/demo),
    else `python -m polar`."""
    argv0 = Path(sys.argv[0])
    found = shutil.which("polar")
    if found is not None and (argv0.name != "polar" or Path(found).resolve() == argv0.resolve()):
        return "polar"
    if argv0.name == "polar" and argv0.is_file():
        rel = os.path.relpath(argv0)
        return rel if not rel.startswith("..") else str(argv0)
    return f"{sys.executable} -m polar"


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def cannot_start(message: str, command: str | None = None) -> CannotStart:
    return CannotStart(f"{command or command_name()}: {message}")


# What an app's startup raises for a problem of the machine or the configuration (an unreachable backend,
# a store that cannot be opened); anything else is a bug and keeps its traceback.
_STARTUP_PROBLEMS = (OSError, RuntimeError, ValueError, sqlite3.Error)


def start_failure(exc: BaseException, command: str, database: Path | None = None) -> CannotStart | None:
    """The one line for a server that could not start (`polar.serving.BindError`, or a `StartupError`
    caused by the machine or the configuration: an unreachable backend, a store that cannot be opened);
    None for anything else, a bug. `database`: the SQLite file the app opens, named when it cannot be."""
    from polar.serving import BindError, StartupError

    if isinstance(exc, BindError):
        hint = f" (another {command}?)" if exc.in_use else ""
        return cannot_start(f"{exc}{hint}", command)
    if isinstance(exc, StartupError):
        error = exc.error
        if isinstance(error, sqlite3.Error) and database is not None:
            return cannot_start(f"{database}: {one_line(error)}", command)
        if isinstance(error, _STARTUP_PROBLEMS):
            return cannot_start(one_line(error), command)
    return None


async def start_servers(start: Awaitable[None], command: str, database: Path | None = None) -> None:
    """Await `start` (servers binding and starting); a port in use or a failed startup is `CannotStart`."""
    from polar.serving import BindError, StartupError

    try:
        await start
    except (BindError, StartupError) as exc:
        failure = start_failure(exc, command, database)
        if failure is not None:
            raise failure from None
        if isinstance(exc, StartupError):
            raise exc.error from None  # a bug: the report handler shows its traceback
        raise


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def release_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Take the stop handlers off `loop` before it closes, so a signal during teardown has its default
    effect. asyncio's `loop.close()` (CPython 3.11) closes the loop's self-pipe first and removes the
    handlers after: a signal in between is written to the closed wakeup fd and printed as "Exception
    ignored when trying to write to the signal wakeup fd" with a traceback (a gateway worker stopped by
    its supervisor while its own start-up failed; tests/test_cli_signals.py reproduces it)."""
    for sig in STOP_SIGNALS:
        loop.remove_signal_handler(sig)


def serve_until_stopped(
    servers: Sequence[EmbeddedServer],
    *,
    started: Callable[[], None] | None = None,
    database: Path | None = None,
    attach: Callable[[], contextlib.AbstractAsyncContextManager[Any]] | None = None,
) -> None:
    """Start `servers` (all bound first; the first runs the app's lifespan), call `started`, serve until
    SIGINT/SIGTERM or until the first server exits, then stop them. A server that cannot start is one
    line and exit status 2 (`start_servers`). `attach()`: what runs beside the servers (`polar serve
    --ray`'s gateway actors), entered once they serve and left before they stop; a `CannotStart` it raises
    on entry stops everything."""
    from polar.serving import start_all, stop_all

    command = command_name()

    async def main() -> None:
        # Handlers first: a signal while the listeners start (the first one already answers) still stops
        # cleanly instead of raising KeyboardInterrupt through asyncio ("Aborted!", exit 1).
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        try:
            await serve(stop)
        finally:
            release_signals(loop)

    async def serve(stop: asyncio.Event) -> None:
        await start_servers(start_all(servers), command, database)
        if started is not None:
            started()
        async with contextlib.AsyncExitStack() as beside:
            try:
                if attach is not None:
                    await beside.enter_async_context(attach())
                waiting = asyncio.create_task(stop.wait())
                await asyncio.wait(
                    [waiting, asyncio.create_task(servers[0].wait())], return_when=asyncio.FIRST_COMPLETED
                )
                waiting.cancel()
            except BaseException:
                await beside.aclose()
                await stop_all(servers)
                raise
        await stop_all(servers)

    asyncio.run(main())


def resolve_token(token_file: Path | None, *, create: bool) -> str:
    """The control token for a command (`create`: servers make the default file when nothing is set; a
    server that finds no usable token cannot start: one line, exit status 2)."""
    from polar.auth import TokenError, load_token

    try:
        return load_token(token_file, create=create)
    except (TokenError, OSError) as exc:
        message = (
            str(exc) if isinstance(exc, TokenError) else f"cannot set up the control token: {one_line(exc)}"
        )
        if create:
            raise cannot_start(message) from None
        raise click.ClickException(message) from None


BACKEND_HELP = (
    "Base URL of the policy's inference server, e.g. http://127.0.0.1:8000. Repeat it (or give @FILE, one "
    "URL a line) for several servers serving the same model: calls go to the least busy one, a session "
    "stays on the server that holds its prefix, and a server that fails its health check is left out."
)


def expand_backends(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """`--backend URL`, repeatable, where `@FILE` stands for the URLs in FILE (one a line, `#` comments)."""
    urls: list[str] = []
    for value in values:
        if not value.startswith("@"):
            urls.append(value)
            continue
        path = Path(value[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise click.BadParameter(f"{path}: {exc.strerror or exc}", ctx, param) from None
        found = [u for u in (line.split("#", 1)[0].strip() for line in text.splitlines()) if u]
        if not found:
            raise click.BadParameter(f"{path} names no server URL", ctx, param)
        urls += found
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{url!r} is not an http(s) URL", ctx, param)
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise click.BadParameter(f"names a server twice: {', '.join(twice)}", ctx, param)
    return tuple(urls)


def gateway_options(*, port: int) -> Callable[[F], F]:
    """The gateway's options, shared by `polar gateway` and `polar node` (which serves one), so an option
    added here reaches both; `build_gateway_config` turns them into a `GatewayConfig`."""

    def decorate(f: F) -> F:
        return _apply(
            f,
            [
                click.option(
                    "--backend",
                    "backend_urls",
                    required=True,
                    multiple=True,
                    metavar="URL",
                    callback=expand_backends,
                    help=BACKEND_HELP,
                ),
                click.option(
                    "--backend-kind",
                    type=click.Choice(["vllm", "sglang", "openai"]),
                    default="vllm",
                    show_default=True,
                    help="vllm/sglang return token ids and logprobs (trainable); openai is any compatible "
                    "endpoint without token data (recorded as not trainable).",
                ),
                click.option(
                    "--model",
                    "served_model",
                    metavar="NAME",
                    help="Model name the backend serves (default: the first one it lists).",
                ),
                host_port_options(port),
                click.option(
                    "--store",
                    "store_path",
                    default="polar.db",
                    show_default=True,
                    type=click.Path(path_type=Path),
                    help="SQLite file where every call is recorded.",
                ),
                click.option(
                    "--control-host",
                    default="127.0.0.1",
                    show_default=True,
                    help="Where the control listener binds (sessions, records, pause; never reachable from "
                    "a sandbox). Loopback unless a server on another machine must reach it.",
                ),
                click.option(
                    "--control-port",
                    type=int,
                    default=port + 1,
                    show_default=True,
                    help="The control listener's port (0: any free one).",
                ),
                click.option(
                    "--render",
                    type=click.Choice(["server", "gateway"]),
                    default="server",
                    show_default=True,
                    help="Who renders the chat template. gateway: the gateway continues each session's "
                    "exact token chain and sends token ids: to /v1/completions (vllm kind: vLLM or the "
                    "embedded engine) or SGLang's /generate; one session stays one trace (docs/backends.md).",
                ),
                click.option(
                    "--tokenizer",
                    metavar="NAME_OR_DIR",
                    help="With --render gateway: the served model's folder (or its id in the local Hugging "
                    "Face cache), for its tokenizer and chat template (default: what the server says it "
                    "loaded the model from).",
                ),
                token_file_option,
                allow_callback_option,
            ],
        )

    return decorate


def build_gateway_config(
    *,
    backend_urls: tuple[str, ...],
    backend_kind: str,
    served_model: str | None,
    host: str,
    port: int,
    store_path: Path,
    control_token: str,
    control_host: str,
    control_port: int,
    allow_callback: tuple[str, ...] = (),
    render: str = "server",
    tokenizer: str | None = None,
    **extra: Any,
) -> GatewayConfig:
    """A `GatewayConfig` from `gateway_options` (plus `extra` fields); a bad value is a usage error."""
    from polar.gateway.config import GatewayConfig

    outbound = outbound_policy(allow_callback)
    try:
        return GatewayConfig(
            backend_urls=backend_urls,
            backend_kind=backend_kind,  # type: ignore[arg-type]
            served_model=served_model,
            store_path=store_path,
            control_token=control_token,
            host=host,
            port=port,
            control_host=control_host,
            control_port=control_port,
            outbound=outbound,
            render=render,  # type: ignore[arg-type]
            tokenizer=tokenizer,
            **extra,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def plugin_option(f: F) -> F:
    """`--plugin MODULE`: modules whose classes tasks over HTTP may name as `module:Name`."""
    return click.option(
        "--plugin",
        "plugins",
        multiple=True,
        metavar="MODULE",
        help="Allow tasks to name harnesses, evaluators and builders from this Python module as "
        "`MODULE:Name` (repeatable). Without it, tasks over HTTP name only built-ins and installed "
        "entry points: code is never imported because a request named it.",
    )(f)


def allow_plugins(modules: tuple[str, ...]) -> None:
    from polar.plugins import PluginError, allow_modules

    try:
        allow_modules(modules)
    except PluginError as exc:
        raise click.BadParameter(str(exc), param_hint="--plugin") from None


def tokenizer_option(f: F) -> F:
    return click.option(
        "--tokenizer",
        metavar="NAME_OR_DIR",
        default=None,
        help="The policy's tokenizer (a local directory or a Hugging Face name already in the cache; never "
        "downloaded), so the dashboard's token view shows text. Without it, token ids.",
    )(f)


def train_dir_option(f: F) -> F:
    return click.option(
        "--train",
        "train_dir",
        metavar="OUT",
        default=None,
        type=click.Path(path_type=Path, exists=True),
        help="A `polar train` out folder (or its metrics.jsonl): the dashboard's training page shows its "
        "curves, following the run while it trains.",
    )(f)


def dashboard_options(tokenizer: str | None, train_dir: Path | None = None) -> DashboardOptions:
    """The dashboard's `DashboardOptions`; a tokenizer that cannot be loaded is a usage error now, not a
    blank token view later."""
    from polar.dashboard import DashboardOptions

    decode = None
    if tokenizer is not None:
        from polar.dashboard.tokens import load_tokenizer

        try:
            decode = load_tokenizer(tokenizer)
        except ImportError:
            raise click.BadParameter(
                "needs transformers: pip install 'polar-rl[engine]'", param_hint="--tokenizer"
            ) from None
        except (OSError, ValueError) as exc:
            raise click.BadParameter(
                f"cannot load {tokenizer!r} offline: {one_line(exc)}", param_hint="--tokenizer"
            ) from None
    return DashboardOptions(train_dir=train_dir, tokenizer=tokenizer, decode=decode)
