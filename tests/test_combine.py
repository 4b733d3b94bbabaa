"""Combined rewards: a task's `evaluators` and `reward: {combine, weights, thresholds}`, checked at load with
`file:line: field: message`, folded as documented, and run on a real node (tests AND a scripted judge)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar.evaluate.base import AgentFault, EvalContext, EvalResult
from polar.evaluate.registry import FieldProblem, build_evaluator
from polar.evaluate.support import EvaluatorError
from polar.rollout.protocol import SessionStatus
from polar.rollout.taskfile import TaskFileError, parse_tasks
from polar.runtime.base import ExecResult
from polar.task import Task
from polar.trajectory import Trajectory
from polar.trajectory.models import Trace
from tests.judge_support import judge_config, scripted_judge, verdict
from tests.node_support import PY, fake_policy, running_node, shell_task, spec, write_caller

HERE = __name__


class Fixed:
    """An evaluator (named by import path, as a task names its own) that returns what its config says."""

    name = "fixed"
    needs_fresh_runtime = False

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        if self.config.get("fault"):
            raise AgentFault("the agent deleted .git")
        if self.config.get("fail"):
            raise EvaluatorError("the test runner is missing")
        return EvalResult(
            reward=self.config.get("reward"),
            trace_rewards=self.config.get("trace_rewards"),
            passed=self.config.get("passed"),
        )


class Fresh(Fixed):
    needs_fresh_runtime = True


def task(evaluators: dict[str, dict[str, Any]], **reward: Any) -> Task:
    named = {
        name: {"strategy": f"{HERE}:{cfg.pop('cls', 'Fixed')}", "config": cfg}
        for name, cfg in evaluators.items()
    }
    return Task.model_validate(
        {"task_id": "t", "instruction": "i", "evaluators": named, "reward": reward or None}
    )


def ctx(traces: int = 1) -> EvalContext:
    trace = Trace.trusted(prompt_ids=[1], response_ids=[2], loss_mask=[1], response_logprobs=[-0.1])
    return EvalContext(
        task=None,
        session_id="s",
        runtime=None,  # type: ignore[arg-type]  # these evaluators read no runtime
        fresh=None,
        agent=ExecResult(0, "", ""),
        trajectory=Trajectory(traces=[trace] * traces),
    )


async def combined(evaluators: dict[str, dict[str, Any]], traces: int = 1, **reward: Any) -> EvalResult:
    evaluator, _ = build_evaluator(task(evaluators, **reward))
    return await evaluator.evaluate(ctx(traces))


@pytest.mark.parametrize(
    ("reward", "expected"),
    [
        ({}, 1.25),  # sum
        ({"combine": "min"}, 0.25),
        ({"combine": "product"}, 0.25),
        ({"combine": "sum", "weights": {"tests": 0.5, "judge": 2}}, 1.0),
        ({"combine": "min", "thresholds": {"judge": 0.2}}, 1.0),  # judge 0.25 >= 0.2 counts 1
        ({"combine": "min", "thresholds": {"judge": 0.5}}, 0.0),  # tests pass AND judge >= 0.5: no
        ({"combine": "product", "thresholds": {"judge": 0.5}, "weights": {"tests": 3}}, 0.0),
    ],
)
async def test_rewards_are_thresholded_weighted_then_combined(
    reward: dict[str, Any], expected: float
) -> None:
    result = await combined({"tests": {"reward": 1.0, "passed": True}, "judge": {"reward": 0.25}}, **reward)
    assert result.reward == pytest.approx(expected)
    parts = result.details["parts"]
    assert list(parts) == ["tests", "judge"] and parts["tests"]["passed"] is True


async def test_a_verdict_needs_every_part_to_have_one() -> None:
    both = {"tests": {"reward": 1.0, "passed": True}, "judge": {"reward": 0.75}}
    assert (await combined(both, combine="min")).passed is None  # a bare score is no verdict
    passed = await combined(both, combine="min", thresholds={"judge": 0.5})
    assert passed.passed is True and passed.details["parts"]["judge"]["passed"] is True
    failed = await combined(both, combine="min", thresholds={"judge": 0.8})
    assert failed.passed is False and failed.reward == 0.0


async def test_per_trace_rewards_combine_trace_by_trace() -> None:
    result = await combined(
        {"turns": {"trace_rewards": [1.0, 0.0, 0.5]}, "outcome": {"reward": 0.5}}, traces=3, combine="min"
    )
    assert result.reward is None and result.trace_rewards == [0.5, 0.0, 0.5]


@pytest.mark.parametrize(
    ("evaluators", "error", "message"),
    [
        (
            {"a": {"reward": 1.0}, "b": {"fail": True}},
            EvaluatorError,
            "evaluator 'b': EvaluatorError: the test",
        ),
        (
            {"a": {"reward": 1.0}, "b": {"reward": None}},
            EvaluatorError,
            "evaluator 'b' gave no finite reward",
        ),
        ({"a": {"reward": float("nan")}}, EvaluatorError, "evaluator 'a' gave no finite reward: nan"),
        ({"a": {"trace_rewards": [1.0, 1.0]}}, EvaluatorError, "gave 2 trace rewards for 1 traces"),
        ({"a": {"reward": 1.0}, "b": {"fault": True}}, AgentFault, "evaluator 'b': the agent deleted .git"),
    ],
)
async def test_one_failing_evaluator_fails_the_whole(
    evaluators: dict[str, Any], error: type[Exception], message: str
) -> None:
    """An error masks the session (the node makes it ERROR); an agent fault is its 0, whatever else paid."""
    with pytest.raises(error) as info:
        await combined(evaluators)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("fields", "where", "message"),
    [
        ('reward: {combine: min, weights: {tests: 1, judge: 1}}', "reward.weights.judge",
         "no evaluator is named 'judge' (evaluators: tests)"),
        ('reward: {thresholds: {quality: 0.5}}', "reward.thresholds.quality",
         "no evaluator is named 'quality' (evaluators: tests)"),
        ('reward: {combine: avg}', "reward.combine", "Input should be 'sum', 'min' or 'product'"),
        ('reward: {weights: {tests: -1}}', "reward.weights", "tests: -1.0 is not a finite number of at least 0"),
        ('evaluator: {strategy: test_on_output, config: {command: "true"}}', "evaluators",
         "give evaluator or evaluators, not both"),
    ],
)  # fmt: skip
def test_task_files_name_the_line_and_field(tmp_path: Path, fields: str, where: str, message: str) -> None:
    text = f"""task_id: t
instruction: i
evaluators:
  tests:
    strategy: session_completed
{fields}
"""
    with pytest.raises(TaskFileError) as info:
        parse_tasks(text, "tasks.yaml", tmp_path, resolve_imports=True)
    line = 4 if where == "evaluators" else 6  # a block mapping is located at its first entry
    assert str(info.value) == f"tasks.yaml:{line}: {where}: {message}"


def test_more_task_file_errors(tmp_path: Path) -> None:
    def error(text: str) -> str:
        with pytest.raises(TaskFileError) as info:
            parse_tasks("task_id: t\ninstruction: i\n" + text, "tasks.yaml", tmp_path, resolve_imports=True)
        return str(info.value)

    assert error("reward: {combine: min}\n") == (
        "tasks.yaml:3: reward: combines the rewards of `evaluators`: name them there"
    )
    assert error("evaluators:\n  Tests: {strategy: session_completed}\n") == (
        "tasks.yaml:4: evaluators: 'Tests': an evaluator's name is a lower-case letter, then lower-case "
        "letters, digits and _ (at most 32)"
    )
    judge = (
        "evaluators:\n  quality:\n    strategy: judge\n    config: {backend: {url: 'http://j', model: m}}\n"
    )
    assert error(judge) == (
        "tasks.yaml:6: evaluators.quality.config: evaluator 'judge': evaluators.quality.config.rubric: "
        "Field required"
    )
    tests = "{strategy: command, config: {test_command: 'true'}}"
    assert error(f"evaluators:\n  a: {tests}\n  b: {tests}\n") == (
        "tasks.yaml:5: evaluators.b.fresh_runtime: only one evaluator gets the fresh runtime, and 'a' has it "
        "(both would change it)"
    )
    with pytest.raises(FieldProblem) as info:  # a task over HTTP gets the same field
        build_evaluator(task({"a": {"cls": "Fresh"}, "b": {"cls": "Fresh"}}))
    assert info.value.field == "evaluators.b.fresh_runtime"


def test_the_evaluation_timeout_is_the_sum_of_the_parts() -> None:
    t = Task.model_validate(
        {
            "task_id": "t",
            "instruction": "i",
            "evaluators": {"a": {"timeout_seconds": 30}, "b": {"timeout_seconds": 90}},
        }
    )
    assert t.evaluation_timeout() == 120
    assert Task.model_validate({"task_id": "t", "instruction": "i"}).evaluation_timeout() == 600


async def test_tests_pass_and_the_judge_approves_on_a_node(tmp_path: Path) -> None:
    """On a real node: the agent writes answer.txt; `tests` checks it in the sandbox, a scripted judge scores
    it (3 for a hedged answer, else 8), and `min` with the judge thresholded at 0.5 pays only when both do."""
    caller = write_caller(tmp_path)

    def grade(body: dict[str, Any]) -> Any:
        return verdict(3 if "maybe" in str(body["messages"]) else 8)

    def judged(task_id: str, answer: str, url: str) -> Task:
        return shell_task(
            f"{PY} {caller} && echo {answer} > answer.txt",
            task_id=task_id,
            evaluators={
                "tests": {
                    "strategy": "test_on_output",
                    "config": {"command": "cat answer.txt", "expect": "Paris", "match": "contains"},
                },
                "quality": {"strategy": "judge", "config": judge_config(url, files=["answer.txt"])},
            },
            reward={"combine": "min", "thresholds": {"quality": 0.5}},
        )

    results = {}
    with fake_policy() as (policy, _), scripted_judge(grade) as (url, judge):
        async with running_node(policy, tmp_path) as node:
            for task_id, answer in [("good", "Paris"), ("hedged", "'Paris maybe'"), ("wrong", "Lyon")]:
                await node.submit(spec(judged(task_id, answer, url), f"s-{task_id}"))
                results[task_id] = await node.wait(f"s-{task_id}")
    assert all(r.status == SessionStatus.COMPLETED for r in results.values()), [
        r.reason for r in results.values()
    ]
    assert [results[t].reward for t in ("good", "hedged", "wrong")] == [1.0, 0.0, 0.0]
    parts = {t: r.metadata["evaluation"]["details"]["parts"] for t, r in results.items()}
    assert parts["good"]["tests"]["reward"] == 1.0 and parts["good"]["quality"]["reward"] == 0.8
    assert parts["hedged"]["tests"]["reward"] == 1.0 and parts["hedged"]["quality"]["counted"] == 0.0
    assert parts["wrong"]["tests"]["reward"] == 0.0 and parts["wrong"]["quality"]["counted"] == 1.0
    assert [results[t].metadata["evaluation"]["passed"] for t in ("good", "hedged", "wrong")] == [
        True,
        False,
        False,
    ]
    assert judge.calls == 3
