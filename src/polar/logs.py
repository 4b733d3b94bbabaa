"""One logging setup for every polar process (the CLI's commands, and gateway nodes started as Ray actors):
plain lines, rich on a terminal, or JSON lines; uvicorn's loggers folded into the same handler."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson
from rich.console import Console
from rich.logging import RichHandler


class JsonFormatter(logging.Formatter):
    """One JSON object per record (`--log-json`), for log shippers: time, level, logger, message and,
    when there is one, the exception's traceback."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc).decode()


PLAIN_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s"

# uvicorn's life-cycle lines, once per listener (a gateway has two: "Started server process" twice), and
# under the logger name `uvicorn.error` although nothing failed. polar logs what it serves where itself.
_UVICORN_LIFECYCLE = (
    "Started server process",
    "Finished server process",
    "Waiting for application startup",
    "Application startup complete",
    "Waiting for application shutdown",
    "Application shutdown complete",
    "Shutting down",
    "Waiting for connections to close",
    "Waiting for background tasks to complete",
)


class _UvicornRecords(logging.Filter):
    """Records of `uvicorn.error` under the name `uvicorn`; its life-cycle lines at DEBUG, not INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.name = "uvicorn"
        if record.levelno == logging.INFO and str(record.msg).startswith(_UVICORN_LIFECYCLE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


# Client libraries that log every request at INFO (a node's heartbeat every few seconds): WARNING and up
# only, unless --log-level debug asks for everything.
_CHATTY = ("httpx", "httpcore", "hpack")


def setup_logging(level: str = "info", *, json: bool = False) -> None:
    """One logging setup for every command, on stderr: rich on a terminal, plain one-line records with a
    timestamp otherwise (files and pipes get no colours and no wrapping at 80 columns), or one JSON object
    per line with `json`. uvicorn's own loggers go through the same handler (polar's servers pass uvicorn
    `log_config=None`), so no line comes out in another format."""
    handler: logging.Handler
    console = Console(stderr=True)
    if json:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    elif console.is_terminal:
        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(PLAIN_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    debug = level.lower() == "debug"
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.DEBUG if debug and name == "httpx" else logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        # Handlers a uvicorn config installed earlier in this process would print in uvicorn's format.
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    error = logging.getLogger("uvicorn.error")
    error.filters = [f for f in error.filters if not isinstance(f, _UvicornRecords)]
    error.addFilter(_UvicornRecords())
