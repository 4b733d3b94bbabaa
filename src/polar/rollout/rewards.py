"""Fail-closed reward assignment: the one place a session's end becomes rewards on its traces.

The evaluator scores; this module decides what of that score a trainer may see (Polar design notes,
"Rewards"). The rules, in order:

- COMPLETED with a usable evaluation: the outcome reward is broadcast to every trace, or the evaluator's
  per-trace rewards are used (their count must match the traces).
- TIMEOUT because the agent spent its own budget (`reason` starts with `AGENT_BUDGET_EXHAUSTED`): a real
  negative example, so reward 0 and the traces stay trainable.
- Any other TIMEOUT (the session deadline: slow runtimes, queueing, infrastructure), ERROR, CANCELLED, or a
  COMPLETED session whose evaluation is missing or malformed: reward 0 and every trace fully masked
  (loss_mask all 0, logprobs 0.0), so nothing the infrastructure broke can push the policy either way.
- A trace holding a call whose tool call the server could not parse (`tool_call_parse_error`): reward 0,
  still trainable, so malformed tool calls are learned against rather than rewarded by a lucky outcome.

The returned trajectory's `status` is authoritative: a COMPLETED session with an unusable evaluation comes
back as ERROR. Reasons land in `Trajectory.metadata["reward_reason"]` and each touched trace's metadata.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from polar.evaluate.base import GROUP_PENDING, EvalResult
from polar.store.records import FLAG_TOOL_PARSE_ERROR
from polar.trajectory.models import Trace, Trajectory, TrajectoryStatus

# The node's reason for a TIMEOUT when the agent ran out of its own budget (counted from RUN), as opposed
# to the session deadline (counted from INIT). Only this kind of timeout stays trainable.
AGENT_BUDGET_EXHAUSTED = "agent budget exhausted"
SESSION_DEADLINE = "session deadline exceeded"

_STATUSES = {"COMPLETED", "TIMEOUT", "ERROR", "CANCELLED"}


def infrastructure_failure(status: str, reason: str | None) -> bool:
    """Whether a session ended for a reason that is not the policy's doing (the rules above: ERROR, or a
    TIMEOUT of the session deadline rather than the agent's own budget). Such a session is fully masked,
    a plain re-run of a local run retries it (`polar.rollout.rundir`), and the run's exit status says so.
    A CANCELLED session is someone's decision, not a failure: it is kept as it is."""
    if status == "ERROR":
        return True
    return status == "TIMEOUT" and not (reason or "").startswith(AGENT_BUDGET_EXHAUSTED)


def has_tool_parse_error(trace: Trace) -> bool:
    """Whether any call in the trace was flagged `tool_call_parse_error` (see `sequences.chain_trace`:
    `metadata["flags"]` maps completion id -> flags; a flat list from a custom builder counts too)."""
    flags = trace.metadata.get("flags")
    groups: Iterable[Any]
    if isinstance(flags, dict):
        groups = flags.values()
    elif isinstance(flags, list):
        groups = [flags]
    else:
        return False
    return any(isinstance(g, list) and FLAG_TOOL_PARSE_ERROR in g for g in groups)


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _masked(trace: Trace, reason: str) -> Trace:
    n = len(trace.response_ids)
    return trace.model_copy(
        update={
            "loss_mask": [0] * n,
            "response_logprobs": [0.0] * n,
            "reward": 0.0,
            "metadata": {**trace.metadata, "masked": True, "reward_reason": reason, "trainable_tokens": 0},
        }
    )


def _rewarded(trace: Trace, reward: float, reason: str | None) -> Trace:
    if has_tool_parse_error(trace):
        reward, reason = 0.0, FLAG_TOOL_PARSE_ERROR
    meta = trace.metadata if reason is None else {**trace.metadata, "reward_reason": reason}
    return trace.model_copy(update={"reward": float(reward), "metadata": meta})


def _finish(
    trajectory: Trajectory,
    status: TrajectoryStatus,
    traces: list[Trace],
    *,
    reward: float | None,
    masked: bool,
    reason: str | None,
    result: EvalResult | None,
) -> Trajectory:
    meta: dict[str, Any] = {**trajectory.metadata, "reward": reward, "masked": masked}
    if reason is not None:
        meta["reward_reason"] = reason
    if result is not None:
        meta["evaluation"] = {"passed": result.passed, "details": result.details}
    return trajectory.model_copy(update={"status": status, "traces": traces, "metadata": meta})


def _mask_all(
    trajectory: Trajectory, status: TrajectoryStatus, reason: str, result: EvalResult | None
) -> Trajectory:
    traces = [_masked(t, reason) for t in trajectory.traces]
    return _finish(trajectory, status, traces, reward=0.0, masked=True, reason=reason, result=result)


def _unusable(result: EvalResult, n_traces: int) -> str | None:
    """Why a COMPLETED session's evaluation cannot be used, or None when it can."""
    if result.trace_rewards is not None:
        if len(result.trace_rewards) != n_traces:
            return f"evaluator gave {len(result.trace_rewards)} trace rewards for {n_traces} traces"
        if not all(_finite(r) for r in result.trace_rewards):
            return "evaluator gave a non-finite trace reward"
        return None
    if result.reward is None:
        return "evaluator gave no reward"
    if not _finite(result.reward):
        return f"evaluator gave a non-finite reward: {result.reward!r}"
    return None


def assign_rewards(
    trajectory: Trajectory,
    status: str,
    result: EvalResult | None,
    *,
    reason: str | None = None,
) -> Trajectory:
    """Rewards (and masks) for a finished session; see the module doc for the rules.

    `status` is the session's terminal status (a `TrajectoryStatus`, a `SessionStatus` or its string);
    `reason` says why it ended so (required to tell an agent-budget TIMEOUT from a deadline one).
    """
    name = str(status)
    if name not in _STATUSES:
        raise ValueError(f"assign_rewards: not a terminal status: {name!r}")
    if name == "COMPLETED":
        if result is None:
            return _mask_all(trajectory, TrajectoryStatus.ERROR, "completed without an evaluation", None)
        if GROUP_PENDING in result.details:
            return _pending(trajectory, result)
        why = _unusable(result, len(trajectory.traces))
        if why is not None:
            return _mask_all(trajectory, TrajectoryStatus.ERROR, why, result)
        n = len(trajectory.traces)
        rewards = (
            result.trace_rewards if result.trace_rewards is not None else [float(result.reward or 0)] * n
        )
        traces = [_rewarded(t, r, None) for t, r in zip(trajectory.traces, rewards, strict=True)]
        return _finish(
            trajectory,
            TrajectoryStatus.COMPLETED,
            traces,
            reward=result.reward,
            masked=False,
            reason=reason,
            result=result,
        )
    if name == "TIMEOUT" and reason is not None and reason.startswith(AGENT_BUDGET_EXHAUSTED):
        traces = [_rewarded(t, 0.0, reason) for t in trajectory.traces]
        return _finish(
            trajectory, TrajectoryStatus.TIMEOUT, traces, reward=0.0, masked=False, reason=reason, result=None
        )
    why = reason or (SESSION_DEADLINE if name == "TIMEOUT" else name.lower())
    if name == "CANCELLED":
        why = f"cancelled: {why}" if reason else "cancelled"
    final = TrajectoryStatus.TIMEOUT if name == "TIMEOUT" else TrajectoryStatus.ERROR
    return _mask_all(trajectory, final, why, result)


# In a pending trajectory's metadata: its reward comes when its group is judged (`judge_group`).
REWARD_PENDING = "reward_pending"
AWAITING_GROUP = "awaiting its group's judgement (judge_group)"
_SETTLED_KEYS = (REWARD_PENDING, "reward", "masked", "reward_reason", "evaluation")


def _pending(trajectory: Trajectory, result: EvalResult) -> Trajectory:
    """A COMPLETED session whose reward its group decides: masked as a whole (trainers leave out masked
    trajectories) with its traces kept as they are, so that `settle_group` can release them trainable."""
    meta = {
        **trajectory.metadata,
        REWARD_PENDING: "judge_group",
        "reward": None,
        "masked": True,
        "reward_reason": AWAITING_GROUP,
        "evaluation": {"passed": result.passed, "details": result.details},
    }
    return trajectory.model_copy(update={"status": TrajectoryStatus.COMPLETED, "metadata": meta})


def settle_group(trajectory: Trajectory, result: EvalResult | None, reason: str | None = None) -> Trajectory:
    """A pending trajectory once its group is judged: rewarded by the rules above with `result`, or, with
    None, fully masked as ERROR with `reason` (the group's judging failed). Anything else is returned as
    it is: only what `_pending` made is settled."""
    if trajectory.metadata.get(REWARD_PENDING) is None:
        return trajectory
    meta = {k: v for k, v in trajectory.metadata.items() if k not in _SETTLED_KEYS}
    fresh = trajectory.model_copy(update={"metadata": meta})
    if result is None:
        why = reason or "its group was not judged"
        return _mask_all(fresh, TrajectoryStatus.ERROR, why, None)
    return assign_rewards(fresh, "COMPLETED", result)
