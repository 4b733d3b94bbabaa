"""`session_completed`: reward 1 when the agent's process exited 0. The cheapest signal, useful for smoke
runs and for harnesses whose own exit code means "task done"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polar.evaluate.base import EvalContext, EvalResult
from polar.evaluate.support import StrictConfig, parse_config


class _Config(StrictConfig):
    pass


class SessionCompleted:
    name = "session_completed"
    needs_fresh_runtime = False

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        parse_config(self.name, _Config, config)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        agent = ctx.agent
        if agent is None:
            return EvalResult(reward=0.0, passed=False, details={"reason": "the agent never ran"})
        if agent.timed_out:
            return EvalResult(reward=0.0, passed=False, details={"reason": "the agent timed out"})
        ok = agent.exit_code == 0
        reason = "the agent exited 0" if ok else f"the agent exited {agent.exit_code}"
        return EvalResult(
            reward=1.0 if ok else 0.0, passed=ok, details={"reason": reason, "exit_code": agent.exit_code}
        )
