"""Fail-closed reward assignment, rule by rule (polar.rollout.rewards)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from polar.evaluate.base import EvalResult
from polar.rollout.protocol import SessionStatus
from polar.rollout.rewards import AGENT_BUDGET_EXHAUSTED, assign_rewards, has_tool_parse_error
from polar.store.records import FLAG_TOOL_PARSE_ERROR
from polar.trajectory.models import Trace, Trajectory, TrajectoryStatus


def _trace(mask: list[int], flags: Any = None) -> Trace:
    meta: dict[str, Any] = {"completion_ids": ["c1"]}
    if flags is not None:
        meta["flags"] = flags
    n = len(mask)
    return Trace(
        prompt_ids=[1, 2],
        response_ids=list(range(10, 10 + n)),
        loss_mask=mask,
        response_logprobs=[-0.5 if m else 0.0 for m in mask],
        metadata=meta,
    )


def _traj(*traces: Trace) -> Trajectory:
    return Trajectory(status=TrajectoryStatus.COMPLETED, traces=list(traces), metadata={"session_id": "s"})


TWO = (_trace([1, 1, 0, 1]), _trace([1, 0]))
PARSE_ERR = _trace([1, 1], flags={"c1": [FLAG_TOOL_PARSE_ERROR]})

# (case id, status, eval result, reason, expected status, expected rewards, expected masked)
CASES = [
    (
        "completed outcome broadcast",
        "COMPLETED",
        EvalResult(reward=1.0),
        None,
        "COMPLETED",
        [1.0, 1.0],
        False,
    ),
    ("completed zero", "COMPLETED", EvalResult(reward=0.0), None, "COMPLETED", [0.0, 0.0], False),
    (
        "completed per-trace",
        "COMPLETED",
        EvalResult(reward=None, trace_rewards=[0.25, 0.75]),
        None,
        "COMPLETED",
        [0.25, 0.75],
        False,
    ),
    (
        "per-trace count mismatch",
        "COMPLETED",
        EvalResult(reward=None, trace_rewards=[1.0]),
        None,
        "ERROR",
        [0.0, 0.0],
        True,
    ),
    (
        "per-trace non-finite",
        "COMPLETED",
        EvalResult(reward=None, trace_rewards=[1.0, math.nan]),
        None,
        "ERROR",
        [0.0, 0.0],
        True,
    ),
    ("no reward at all", "COMPLETED", EvalResult(reward=None), None, "ERROR", [0.0, 0.0], True),
    ("nan reward", "COMPLETED", EvalResult(reward=math.nan), None, "ERROR", [0.0, 0.0], True),
    ("inf reward", "COMPLETED", EvalResult(reward=math.inf), None, "ERROR", [0.0, 0.0], True),
    ("completed without evaluation", "COMPLETED", None, None, "ERROR", [0.0, 0.0], True),
    (
        "agent budget timeout trainable",
        "TIMEOUT",
        None,
        AGENT_BUDGET_EXHAUSTED + " after 300s",
        "TIMEOUT",
        [0.0, 0.0],
        False,
    ),
    (
        "agent budget timeout ignores a passing evaluation",
        "TIMEOUT",
        EvalResult(reward=1.0),
        AGENT_BUDGET_EXHAUSTED,
        "TIMEOUT",
        [0.0, 0.0],
        False,
    ),
    ("session deadline masked", "TIMEOUT", None, "session deadline exceeded", "TIMEOUT", [0.0, 0.0], True),
    ("timeout without reason masked", "TIMEOUT", None, None, "TIMEOUT", [0.0, 0.0], True),
    ("error masked", "ERROR", None, "runtime failed to start", "ERROR", [0.0, 0.0], True),
    (
        "error masked despite reward",
        "ERROR",
        EvalResult(reward=1.0),
        "evaluator crashed",
        "ERROR",
        [0.0, 0.0],
        True,
    ),
    ("cancelled masked", "CANCELLED", None, "early stop", "ERROR", [0.0, 0.0], True),
]


@pytest.mark.parametrize(
    ("status", "result", "reason", "want_status", "want_rewards", "want_masked"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_rules(
    status: str,
    result: EvalResult | None,
    reason: str | None,
    want_status: str,
    want_rewards: list[float],
    want_masked: bool,
) -> None:
    before = _traj(*TWO)
    out = assign_rewards(before, status, result, reason=reason)
    assert out.status == want_status
    assert [t.reward for t in out.traces] == want_rewards
    assert out.metadata["masked"] is want_masked
    assert out.metadata["session_id"] == "s"
    for got, orig in zip(out.traces, before.traces, strict=True):
        assert got.response_ids == orig.response_ids and got.prompt_ids == orig.prompt_ids
        if want_masked:
            assert got.loss_mask == [0] * len(orig.response_ids)
            assert got.response_logprobs == [0.0] * len(orig.response_ids)
            assert got.metadata["masked"] is True
            assert got.metadata["reward_reason"] == out.metadata["reward_reason"]
            assert got.metadata["trainable_tokens"] == 0
        else:
            assert got.loss_mask == orig.loss_mask
            assert got.response_logprobs == orig.response_logprobs
        # The result still validates as a Trace (aligned lengths).
        Trace.model_validate(got.model_dump())
    # The input is not mutated.
    assert [t.reward for t in before.traces] == [None, None]
    assert before.traces[0].loss_mask == [1, 1, 0, 1]


def test_masked_reasons_are_recorded() -> None:
    out = assign_rewards(_traj(*TWO), SessionStatus.ERROR, None, reason="runtime failed to start: no bwrap")
    assert out.metadata["reward_reason"] == "runtime failed to start: no bwrap"
    out = assign_rewards(_traj(*TWO), "COMPLETED", EvalResult(reward=None, trace_rewards=[1.0]))
    assert out.metadata["reward_reason"] == "evaluator gave 1 trace rewards for 2 traces"
    out = assign_rewards(_traj(*TWO), "TIMEOUT", None)
    assert out.metadata["reward_reason"] == "session deadline exceeded"


def test_evaluation_is_kept_in_metadata() -> None:
    result = EvalResult(reward=1.0, passed=True, details={"exit_code": 0})
    out = assign_rewards(_traj(*TWO), TrajectoryStatus.COMPLETED, result)
    assert out.metadata["reward"] == 1.0
    assert out.metadata["evaluation"] == {"passed": True, "details": {"exit_code": 0}}


@pytest.mark.parametrize("status", ["COMPLETED", "TIMEOUT"])
def test_tool_parse_error_zeroes_but_stays_trainable(status: str) -> None:
    traj = _traj(TWO[0], PARSE_ERR)
    reason = AGENT_BUDGET_EXHAUSTED if status == "TIMEOUT" else None
    out = assign_rewards(traj, status, EvalResult(reward=1.0), reason=reason)
    assert out.metadata["masked"] is False
    want_first = 1.0 if status == "COMPLETED" else 0.0
    assert [t.reward for t in out.traces] == [want_first, 0.0]
    assert out.traces[1].loss_mask == [1, 1]
    assert out.traces[1].metadata["reward_reason"] == FLAG_TOOL_PARSE_ERROR


def test_tool_parse_error_overrides_per_trace_reward() -> None:
    out = assign_rewards(
        _traj(PARSE_ERR, TWO[1]), "COMPLETED", EvalResult(reward=None, trace_rewards=[1.0, 0.5])
    )
    assert [t.reward for t in out.traces] == [0.0, 0.5]


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (None, False),
        ({"c1": ["missing_logprobs"]}, False),
        ({"c1": [], "c2": ["not_trainable", FLAG_TOOL_PARSE_ERROR]}, True),
        ([FLAG_TOOL_PARSE_ERROR], True),  # a custom builder's flat list
        ("tool_call_parse_error", False),  # not a recognised shape
    ],
)
def test_has_tool_parse_error(flags: Any, want: bool) -> None:
    assert has_tool_parse_error(_trace([1], flags=flags)) is want


def test_empty_trajectory() -> None:
    out = assign_rewards(Trajectory(), "COMPLETED", EvalResult(reward=1.0))
    assert out.status == "COMPLETED" and out.traces == [] and out.metadata["reward"] == 1.0
    out = assign_rewards(Trajectory(), "ERROR", None, reason="harness crashed")
    assert out.status == "ERROR" and out.metadata["masked"] is True


@pytest.mark.parametrize("status", ["RUNNING", "REGISTERED", "nonsense"])
def test_non_terminal_status_is_refused(status: str) -> None:
    with pytest.raises(ValueError, match="not a terminal status"):
        assign_rewards(_traj(*TWO), status, None)
