"""The rollout server (`polar serve`): durable tasks and sessions, node scheduling, trainer callbacks."""

from polar.rollout.server.app import create_app
from polar.rollout.server.config import ServerConfig
from polar.rollout.server.service import RolloutService

__all__ = ["RolloutService", "ServerConfig", "create_app"]
