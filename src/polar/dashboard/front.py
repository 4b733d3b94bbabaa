"""One listener, two doors: `/ui/...` goes to the dashboard (its own login, `polar.dashboard.guard`),
everything else to the control routes behind the bearer token. Both are the control listener: the
dashboard is never served where a session's sandbox can connect."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

PREFIX = "/ui"


def is_dashboard(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


class FrontDoor:
    def __init__(self, dashboard: ASGIApp, control: ASGIApp) -> None:
        self.dashboard, self.control = dashboard, control

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_dashboard(scope["path"]):
            await self.dashboard(scope, receive, send)
        else:
            await self.control(scope, receive, send)


def dashboard_url(server_url: str, token: str, page: str = "") -> str:
    """The link to print: the token rides in the fragment, which the browser never sends anywhere."""
    return f"{server_url.rstrip('/')}{PREFIX}/{page}#token={token}"
