"""The evaluator contract.

An evaluator sees the finished session (its runtime, still alive; the harness's result; the trajectory) and,
when it asks for one, a *fresh* runtime prepared from the task while the agent ran, where it can apply the
agent's diff and run tests without anything the agent left behind. It returns one outcome reward (broadcast
to every trace) or one reward per trace. Rewards are fail-closed: the node, not the evaluator, masks errors
and zeroes non-completed sessions (see `polar.rollout.rewards`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from polar.runtime.base import ExecResult, Runtime
from polar.task import Task
from polar.trajectory.models import Trajectory


@dataclass(frozen=True)
class ModelSession:
    """A gateway session an evaluator calls a frozen model through: `base_url` is the gateway's model API
    (".../v1", reachable from the node), `session_id` its API key."""

    session_id: str
    base_url: str


class EvaluatorModels(Protocol):
    """Frozen models an evaluator calls (a judge). Each call goes through a gateway session of its own,
    opened on the control plane, so it is recorded like a policy call (replayable, shown with the session it
    judged) but tagged `tag` and never trainable; the route lives in that session, never in a policy one."""

    @property
    def state_path(self) -> Path | None:
        """The node's store file: where evaluators keep what must outlive a run (a judge's cache)."""
        ...

    async def open_session(
        self, tag: str, backend: Mapping[str, str], judged: str, metadata: Mapping[str, Any]
    ) -> ModelSession:
        """A new session whose every call goes to `backend` ({url, kind, model}), linked to the session
        `judged`; ValueError when the backend cannot be routed to."""
        ...

    async def close_session(self, session_id: str) -> None:
        """Refuse the session's key from now on."""
        ...


@dataclass(frozen=True)
class EvalContext:
    task: Task | None  # None only when an evaluator is driven outside a rollout (tests, notebooks)
    session_id: str
    runtime: Runtime  # the agent's runtime, after the agent finished
    fresh: Runtime | None  # a clean runtime prepared from the task (when the evaluator asked for one)
    agent: ExecResult | None  # the harness process's result (None if it never ran)
    trajectory: Trajectory
    config: dict[str, Any] = field(default_factory=dict)  # the task's evaluator.config
    models: EvaluatorModels | None = None  # frozen models through the gateway (the node's; None elsewhere)


# In `EvalResult.details`: the reward is not known yet, it comes when the session's group is judged together
# (`judge_group`: {"outcome": the rendered outcome, "part": its name among `evaluators`, or None}). The node
# masks such a trajectory (`reward_pending`) and the server settles it (`polar.rollout.server.grouping`).
GROUP_PENDING = "group_pending"


@dataclass(frozen=True)
class EvalResult:
    reward: float | None  # outcome reward, broadcast to every trace; None: see trace_rewards
    trace_rewards: list[float] | None = None  # one per trace, when the evaluator scores them apart
    passed: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)


class AgentFault(Exception):
    """The agent broke, in its own runtime, what the evaluation needs (its workdir's git, its container's
    bash, the files the evaluator copies): the node scores it 0 with this reason. Never ERROR: a masked
    sample would spare a policy the 0 it earned, so breaking the evaluation would pay."""


class Evaluator(Protocol):
    name: str
    needs_fresh_runtime: bool

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        """Raise on an evaluator failure (it becomes an ERROR session, fully masked), never guess; raise
        `AgentFault` when the agent's own doing keeps it from evaluating (reward 0)."""
        ...
