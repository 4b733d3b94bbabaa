"""The web dashboard (`/ui` on the rollout server): live topology, tasks and sessions, a session's
conversation, records and token view, cancel, and a training run's curves. See docs/dashboard.md."""

from polar.dashboard.app import Dashboard, DashboardOptions
from polar.dashboard.front import FrontDoor, dashboard_url
from polar.dashboard.serve import server_app

__all__ = ["Dashboard", "DashboardOptions", "FrontDoor", "dashboard_url", "server_app"]
