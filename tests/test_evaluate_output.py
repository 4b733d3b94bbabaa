"""`session_completed` and `test_on_output` against real local runtimes."""

# ruff: noqa: F811  (`make_repo` is a fixture imported from tests.evaluate_support)
from __future__ import annotations

import pytest

from polar.evaluate import EvaluatorError, SessionCompleted, TestOnOutput, get_evaluator
from polar.runtime.base import ExecResult, RuntimeFailure
from tests.evaluate_support import context, make_repo  # noqa: F401


@pytest.mark.parametrize(
    ("agent", "reward", "reason"),
    [
        (ExecResult(0, "done", ""), 1.0, "the agent exited 0"),
        (ExecResult(3, "", "turn limit"), 0.0, "the agent exited 3"),
        (ExecResult(-9, "", ""), 0.0, "the agent exited -9"),
        (ExecResult(124, "", "", timed_out=True), 0.0, "the agent timed out"),
        (None, 0.0, "the agent never ran"),
    ],
)
async def test_session_completed(make_repo, agent: ExecResult | None, reward: float, reason: str) -> None:
    rt = await make_repo(git=False)
    ev = get_evaluator("session_completed", {})
    assert isinstance(ev, SessionCompleted) and not ev.needs_fresh_runtime
    res = await ev.evaluate(context(rt, None, agent))
    assert res.reward == reward and res.passed is (reward == 1.0)
    assert res.details["reason"] == reason


def test_session_completed_takes_no_config() -> None:
    with pytest.raises(ValueError, match=r"evaluator 'session_completed': evaluator.config.strict"):
        get_evaluator("session_completed", {"strict": True})


def output(**config: object) -> TestOnOutput:
    ev = get_evaluator("test_on_output", config)
    assert isinstance(ev, TestOnOutput) and not ev.needs_fresh_runtime
    return ev


async def _agent_wrote(make_repo, text: str):  # type: ignore[no-untyped-def]
    rt = await make_repo(git=False)
    (rt.workdir / "answer.txt").write_text(text)
    return rt


@pytest.mark.parametrize(
    ("config", "reward", "reason"),
    [
        ({"command": "cat answer.txt"}, 1.0, "check passed"),
        ({"command": "cat answer.txt", "expect": "42"}, 1.0, "check passed"),
        ({"command": "cat answer.txt", "expect": "4"}, 0.0, "output does not match (exact)"),
        ({"command": "cat answer.txt", "expect": "4", "match": "contains"}, 1.0, "check passed"),
        ({"command": "cat answer.txt", "expect": r"^\d+$", "match": "regex"}, 1.0, "check passed"),
        (
            {"command": "cat answer.txt", "expect": r"^[a-z]+$", "match": "regex"},
            0.0,
            "output does not match (regex)",
        ),
        ({"command": "cat answer.txt >&2", "expect": "42", "stream": "stderr"}, 1.0, "check passed"),
        ({"command": "cat answer.txt >&2", "expect": "42"}, 0.0, "output does not match (exact)"),
        ({"command": "grep -q 43 answer.txt"}, 0.0, "check exited 1"),
        ({"command": "cat missing.txt"}, 0.0, "check exited 1"),
        ({"command": 'test "$WANT" = "$(cat answer.txt)"', "env": {"WANT": "42"}}, 1.0, "check passed"),
        ({"command": "sleep 30", "timeout_seconds": 0.5}, 0.0, "check timed out"),
    ],
)
async def test_on_output(make_repo, config: dict[str, object], reward: float, reason: str) -> None:
    rt = await _agent_wrote(make_repo, "42\n")
    res = await output(**config).evaluate(context(rt))
    assert (res.reward, res.details["reason"]) == (reward, reason), res.details


async def test_on_output_runs_in_the_agents_runtime(make_repo) -> None:
    rt = await _agent_wrote(make_repo, "42\n")
    other = await make_repo(git=False)
    # A fresh runtime, even when given, is not where the agent's output is.
    res = await output(command="cat answer.txt", expect="42").evaluate(context(rt, other))
    assert res.reward == 1.0


async def test_on_output_missing_tool_raises(make_repo) -> None:
    rt = await _agent_wrote(make_repo, "42\n")
    with pytest.raises(EvaluatorError, match="could not run"):
        await output(command="no-such-checker answer.txt").evaluate(context(rt))


async def test_on_output_stopped_runtime_raises(make_repo) -> None:
    rt = await _agent_wrote(make_repo, "42\n")
    await rt.stop()
    with pytest.raises(RuntimeFailure):
        await output(command="cat answer.txt").evaluate(context(rt))


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({}, "command"),
        ({"command": ""}, "command"),
        (
            {"command": "true", "expect": "(", "match": "regex"},
            "expect is not a valid regex",
        ),
        ({"command": "true", "match": "fuzzy"}, "match"),
        ({"command": "true", "timeout_seconds": 0}, "timeout_seconds"),
        ({"command": "true", "bogus": 1}, "bogus"),
    ],
)
def test_on_output_bad_config(config: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"evaluator 'test_on_output': evaluator\.config[.:] ?{field}"):
        get_evaluator("test_on_output", config)
