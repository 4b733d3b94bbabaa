"""How a browser proves it holds the control token, once, without the token living in the browser.

Browsers cannot put `Authorization: Bearer` on a page navigation or an EventSource, so the dashboard has
its own login: `polar run`/`polar serve` print `http://HOST:PORT/ui/#token=...`. A URL fragment is never
sent to a server (nor written to its access log); the login page's script reads it, drops it from the
address bar and history, and POSTs it once to `/ui/login` as a bearer header. The answer sets a cookie
that is *not* the token: a random id this process remembers for `ttl_s`, `HttpOnly` (no script reads it)
and `SameSite=Strict` (no other site's page sends it). A restart forgets every id: log in again.

Requests that change something (cancel) additionally need `X-Polar-CSRF` with the value the page was
rendered with for that login: a page of another origin can neither read it nor send a custom header
without a CORS preflight, which this server never grants. Scripts may skip the cookie and send the bearer
token on any dashboard route, as on every other control route.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from polar.auth import token_matches

if TYPE_CHECKING:
    from starlette.types import Scope

COOKIE = "polar_ui"
CSRF_HEADER = "x-polar-csrf"
DEFAULT_TTL_S = 12 * 3600.0
MAX_SESSIONS = 1024  # logins kept at once; the oldest is forgotten first


@dataclass(frozen=True)
class Login:
    """One browser's login: `csrf` goes into its pages, `expires` is absolute (unix seconds)."""

    sid: str
    csrf: str
    expires: float


class Logins:
    """The cookie ids this process handed out, in memory only."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_sid: dict[str, Login] = {}

    def create(self) -> Login:
        now = self._clock()
        self._by_sid = {k: v for k, v in self._by_sid.items() if v.expires > now}
        while len(self._by_sid) >= MAX_SESSIONS:
            self._by_sid.pop(next(iter(self._by_sid)))
        login = Login(secrets.token_urlsafe(32), secrets.token_urlsafe(24), now + self.ttl_s)
        self._by_sid[login.sid] = login
        return login

    def get(self, sid: str | None) -> Login | None:
        """The login behind a cookie value, or None (unknown, forged or expired: an expired one is dropped)."""
        if not sid:
            return None
        login = self._by_sid.get(sid)
        if login is None:
            return None
        if login.expires <= self._clock():
            self._by_sid.pop(sid, None)
            return None
        return login

    def drop(self, sid: str | None) -> None:
        if sid:
            self._by_sid.pop(sid, None)


def cookie_header(login: Login, secure: bool, ttl_s: float) -> str:
    """`Path=/ui`: the cookie goes to the dashboard only, never to the control API beside it."""
    attrs = [
        f"{COOKIE}={login.sid}",
        "Path=/ui",
        "HttpOnly",
        "SameSite=Strict",
        f"Max-Age={max(1, int(ttl_s))}",
    ]
    if secure:
        attrs.append("Secure")
    return "; ".join(attrs)


def clear_cookie_header() -> str:
    return f"{COOKIE}=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0"


def cookie_of(headers: dict[bytes, bytes]) -> str | None:
    raw = headers.get(b"cookie")
    if not raw:
        return None
    for part in raw.decode("latin-1").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None


@dataclass(frozen=True)
class Caller:
    """Who is asking: a browser login (cookie) or a script with the bearer token (`login` None)."""

    login: Login | None

    def csrf_ok(self, header: str | None) -> bool:
        if self.login is None:
            return True  # a bearer header is not sent by a browser on its own: nothing to forge
        return header is not None and hmac.compare_digest(header.encode(), self.login.csrf.encode())


def identify(scope: Scope, token: str, logins: Logins) -> tuple[Caller | None, str]:
    """The caller of a request, or None and why it is refused."""
    headers = dict(scope.get("headers") or [])
    bearer = headers.get(b"authorization")
    if bearer is not None:
        if token_matches(bearer, token):
            return Caller(None), ""
        return None, "wrong control token"
    sid = cookie_of(headers)
    if sid is None:
        return None, "not logged in"
    login = logins.get(sid)
    if login is None:
        return None, "unknown or expired dashboard login"
    return Caller(login), ""
