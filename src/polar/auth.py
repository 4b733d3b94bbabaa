"""The control plane's one shared secret: where it comes from, how it is sent, how it is checked.

Every control route of every polar server (the rollout server, a node's control listener, a gateway's
control listener) needs `Authorization: Bearer <token>`; the model API that sessions reach never takes it.
The token is set once for a deployment and found, in this order:

1. `--token-file PATH` (the whole file, whitespace stripped),
2. the environment variable `POLAR_TOKEN`,
3. the default file `$XDG_CONFIG_HOME/polar/token` (`~/.config/polar/token`), which a server creates
   (mode 0600) on first start when none of the above is set, so `polar serve`, `polar node` and
   `polar submit` on one machine agree without configuration.

`polar run` makes a fresh token per run and keeps it in memory. There is no unauthenticated mode.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import orjson

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("polar.auth")

TOKEN_ENV = "POLAR_TOKEN"
MIN_TOKEN_CHARS = 16  # a short shared secret is guessable over the network


class TokenError(ValueError):
    """No usable token: the message says where one was looked for and how to set one."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def default_token_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "polar" / "token"


def _checked(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"{where}: the token must be at least {MIN_TOKEN_CHARS} characters")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise TokenError(f"{where}: the token must be printable and contain no whitespace")
    return token


def _read(path: Path) -> str:
    try:
        return _checked(path.read_text(), str(path))
    except OSError as exc:
        raise TokenError(f"{path}: cannot read the token file: {exc.strerror}") from None


def _create(path: Path) -> str:
    """Write a new token to `path` with O_EXCL (two servers starting at once agree on one file)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = new_token()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.info("wrote a new control token to %s", path)
    return token


def load_token(token_file: str | Path | None = None, *, create: bool = False) -> str:
    """The deployment's token (see the module docstring for the order); `create` makes the default file
    when nothing is set (servers do, clients do not: a fresh token would not match any server)."""
    if token_file is not None:
        return _read(Path(token_file))
    env = os.environ.get(TOKEN_ENV)
    if env:
        return _checked(env, f"${TOKEN_ENV}")
    default = default_token_file()
    if default.exists():
        return _read(default)
    if create:
        return _create(default)
    raise TokenError(
        f"no control token: set {TOKEN_ENV}, pass --token-file, or start `polar serve` here first "
        f"(it writes {default})"
    )


def bearer(token: str) -> dict[str, str]:
    """The header every polar client sends to a control route."""
    return {"authorization": f"Bearer {token}"}


def token_matches(header: str | bytes | None, token: str) -> bool:
    """Constant-time check of an `Authorization: Bearer ...` value against `token`."""
    if header is None:
        return False
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


Refusal: TypeAlias = "Callable[[Scope, str], Awaitable[None] | None]"


class RequireToken:
    """ASGI middleware: every HTTP request except `open_paths` must carry the token, else 401 with a JSON
    body naming what is missing. `on_refused(scope, why)` lets a server count refusals (so a client with
    the wrong token shows up in `polar status` instead of failing silently)."""

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        *,
        open_paths: Iterable[str] = ("/health",),
        on_refused: Refusal | None = None,
    ) -> None:
        self.app = app
        self.token = token
        self.open_paths = frozenset(open_paths)
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or []).get(b"authorization")
        if token_matches(header, self.token):
            await self.app(scope, receive, send)
            return
        why = "wrong control token" if header else "missing control token"
        if self.on_refused is not None:
            maybe = self.on_refused(scope, why)
            if maybe is not None:
                await maybe
        message = (
            f"{why}: control routes need `Authorization: Bearer <token>` with the deployment's token "
            f"({TOKEN_ENV}, --token-file, or {default_token_file()})"
        )
        body = orjson.dumps({"error": {"message": message, "type": "authentication_error"}})
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="polar"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
