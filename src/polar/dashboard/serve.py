"""The rollout server with its dashboard on one listener: what `polar serve`, `polar run` and `polar train`
serve. The server (`polar.rollout.server.app`) knows nothing of the dashboard; the dashboard is its `Front`."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Scope

from polar.dashboard.app import Dashboard, DashboardOptions
from polar.dashboard.front import FrontDoor
from polar.rollout.server.app import create_app
from polar.rollout.server.config import ServerConfig
from polar.rollout.server.service import RolloutService


class DashboardFront:
    """`/ui/...` to the dashboard, everything else to the server's API (`FrontDoor`)."""

    def __init__(self, options: DashboardOptions) -> None:
        self.options = options
        self.ui: Dashboard | None = None

    def wrap(
        self,
        api: ASGIApp,
        token: str,
        service: Callable[[], RolloutService | None],
        refused: Callable[[Scope, str], None],
    ) -> FrontDoor:
        self.ui = Dashboard(token, self.options, service, on_refused=refused)
        return FrontDoor(self.ui, api)

    async def aclose(self) -> None:
        if self.ui is not None:
            await self.ui.aclose()


def server_app(config: ServerConfig, options: DashboardOptions | None = None) -> ASGIApp:
    """The server's ASGI app with the dashboard under /ui (`options`: its tokenizer, training folder, ...)."""
    return create_app(config, DashboardFront(options or DashboardOptions()))
