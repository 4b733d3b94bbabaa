"""The dashboard's door (ASGI): nothing under /ui answers without a login or the bearer token, changes
need the CSRF header, and every answer carries headers that keep the page from being framed, cached or
running script it did not ship (see `polar.dashboard.auth` for the login itself)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

import orjson

from polar.dashboard.auth import CSRF_HEADER, Logins, identify

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

SAFE_METHODS = frozenset({"GET", "HEAD"})
LOGIN_PATH = "/ui/login"

Render = Callable[[str], str]  # nonce -> the login page's HTML
Refused: TypeAlias = "Callable[[Scope, str], None]"


def security_headers(nonce: str) -> list[tuple[bytes, bytes]]:
    csp = (
        f"default-src 'self'; script-src 'self' 'nonce-{nonce}'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'self'; object-src 'none'"
    )
    return [
        (b"content-security-policy", csp.encode()),
        (b"x-frame-options", b"DENY"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        (b"cache-control", b"no-store"),
    ]


class Guard:
    """Wraps the dashboard's Starlette app. `render_login(nonce)` is the page a browser gets instead of
    what it asked for; `on_refused(scope, why)` counts refusals where the server shows them."""

    def __init__(
        self,
        app: ASGIApp,
        token: str,
        logins: Logins,
        render_login: Render,
        on_refused: Refused | None = None,
    ) -> None:
        self.app, self.token, self.logins = app, token, logins
        self.render_login, self.on_refused = render_login, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        nonce = secrets.token_urlsafe(16)
        extra = security_headers(nonce)

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        state = scope.setdefault("state", {})
        state["nonce"] = nonce
        if scope["path"] == LOGIN_PATH and scope["method"] == "POST":
            await self.app(scope, receive, send_secured)  # the route checks the token it is given
            return
        caller, why = identify(scope, self.token, self.logins)
        if caller is None:
            await self._refuse(scope, send_secured, 401, why, nonce)
            return
        if scope["method"] not in SAFE_METHODS:
            header = dict(scope.get("headers") or []).get(CSRF_HEADER.encode())
            if not caller.csrf_ok(header.decode("latin-1") if header is not None else None):
                await self._refuse(scope, send_secured, 403, f"missing or wrong {CSRF_HEADER} header", nonce)
                return
        state["caller"] = caller
        await self.app(scope, receive, send_secured)

    async def _refuse(self, scope: Scope, send: Send, status: int, why: str, nonce: str) -> None:
        if self.on_refused is not None:
            self.on_refused(scope, f"dashboard: {why}")
        accept = dict(scope.get("headers") or []).get(b"accept", b"")
        navigation = scope["method"] == "GET" and b"text/html" in accept and status == 401
        if navigation:
            body, ctype = self.render_login(nonce).encode(), b"text/html; charset=utf-8"
        else:
            message = (
                f"{why}: the dashboard needs a login (open the URL with #token=... that polar printed) "
                "or `Authorization: Bearer <token>`"
            )
            if status == 403:
                message = f"{why}: changes from the dashboard need the page's CSRF header"
            kind = "authentication_error" if status == 401 else "permission_error"
            body, ctype = orjson.dumps({"error": {"message": message, "type": kind}}), b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
