"""Held-out evaluation's arithmetic and config (polar.train.evaluation); the loop running it on real sessions,
one policy version per evaluation, is in tests/test_train_loop.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from polar.dashboard.training import EVAL_TITLE, TrainingRun
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.task import Task
from polar.train.config import ConfigError, parse_config, upload_roots
from polar.train.evaluation import EvalPlan, Evaluator, interval, score


def result(task_id: str, reward: float | None, **trajectory: Any) -> SessionResult:
    return SessionResult(
        session_id=f"{task_id}-{reward}-{len(trajectory)}",
        task_id=task_id,
        status=SessionStatus.COMPLETED,
        reward=reward,
        trajectory=trajectory or None,
    )


def test_the_interval_resamples_tasks_not_samples() -> None:
    assert interval({"a": [1.0, 1.0], "b": [1.0]}) == (1.0, 1.0, 1.0)
    assert all(math.isnan(x) for x in interval({}))
    # Two tasks, one solved and one not: resampling tasks can draw either twice, so the interval is [0, 1],
    # however many samples each has (resampling samples would call it 0.5 +- a little).
    assert interval({"a": [1.0] * 50, "b": [0.0] * 50}) == (0.5, 0.0, 1.0)
    accuracy, low, high = interval({f"t{i}": [float(i % 4 == 0)] * 4 for i in range(40)})
    assert accuracy == 0.25 and low < 0.25 < high and high - low < 0.5
    assert interval({"a": [1.0, 0.0], "b": [0.0]}, seed=3) == interval({"b": [0.0], "a": [1.0, 0.0]}, seed=3)


def test_scores_come_from_the_evaluation_else_the_threshold_and_masked_sessions_are_apart() -> None:
    trace = {"prompt_ids": [1], "response_ids": [2], "loss_mask": [1], "response_logprobs": [-0.1]}
    results = [
        result("a-eval00002", 1.0),
        result("a-eval00002", 0.5),  # below the threshold of 1
        result(
            "a-eval00002", 0.2, metadata={"evaluation": {"passed": True}}, traces=[]
        ),  # its evaluation says
        result("b-eval00002", None),  # masked
        # scored per trace: the mean of the traces' rewards
        result("b-eval00002", None, traces=[{**trace, "reward": 1.0}, {**trace, "reward": 0.0}]),
    ]
    by_task, rewards, errors = score(results, {"a-eval00002": "a", "b-eval00002": "b"}, pass_threshold=1.0)
    assert by_task == {"a": [1.0, 0.0, 1.0], "b": [0.0]} and rewards == [1.0, 0.5, 0.2, 0.5] and errors == 1


def test_evaluations_are_due_before_training_every_n_steps_and_after_the_last() -> None:
    task = Task(task_id="t", instruction="x")
    due = Evaluator(EvalPlan((task,), every=3), None, "run")  # type: ignore[arg-type]
    assert [s for s in range(0, 11) if due.due(s, last=10)] == [0, 3, 6, 9, 10]
    late = Evaluator(EvalPlan((task,), every=3, before_training=False), None, "run")  # type: ignore[arg-type]
    assert [s for s in range(0, 7) if late.due(s, last=6)] == [3, 6]
    # Each evaluation's tasks get ids of their own (a held-out id may repeat a training task's).
    copy = due._task(task.model_copy(update={"num_samples": 4}), 6, 6)
    assert copy.task_id == "t-run-eval00006" and copy.num_samples == 4
    assert copy.metadata == {
        "source_task_id": "t",
        "policy_version": 6,
        "run_id": "run",
        "eval": True,
        "eval_step": 6,
    }


def test_the_dashboard_draws_accuracy_at_evaluated_steps_with_its_interval(tmp_path: Path) -> None:
    run = TrainingRun(
        tmp_path,
        steps=[1, 2, 3, 4],
        series={
            "reward_mean": [0.1, 0.2, 0.3, 0.4],
            "eval_accuracy": [None, 0.25, None, 0.5],
            "eval_accuracy_low": [None, 0.1, None, 0.3],
            "eval_accuracy_high": [None, 0.4, None, 0.7],
        },
    )
    chart = next(c for c in run.charts() if c["title"] == EVAL_TITLE)
    assert chart["x"] == [2, 4] and chart["series"]["eval_accuracy"] == [0.25, 0.5]
    assert chart["band"] == ["eval_accuracy_high", "eval_accuracy_low"]


def test_eval_tasks_load_like_tasks_and_errors_name_their_line(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("task_id: t\ninstruction: do it\n")
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "h.yaml").write_text(
        "- {task_id: t, instruction: x}\n- {task_id: u, instruction: y}\n"
    )
    config, tasks = parse_config(
        "tasks: t.yaml\neval: {tasks: held/h.yaml, every: 5, samples: 3}\n", "c.yaml", tmp_path
    )
    assert config.eval is not None and [t.task_id for t in tasks] == ["t"]
    assert [(t.task_id, t.num_samples) for t in config.eval.loaded_tasks] == [("t", 3), ("u", 3)]
    assert upload_roots(config, tmp_path / "c.yaml") == (tmp_path, tmp_path / "held")
    for text, expected in [
        ("eval:\n  tasks: []\n", "c.yaml:3: eval.tasks: must be a task file"),
        ("eval:\n  tasks: gone.yaml\n", "c.yaml:3: eval.tasks: "),
        (
            "eval:\n  tasks:\n    - {task_id: a, instruction: x}\n    - {task_id: a, instruction: y}\n",
            "c.yaml:4: eval.tasks: duplicate task_id a",
        ),
        (
            "eval:\n  tasks: held/h.yaml\n  every: 0\n",
            "c.yaml:4: eval.every: Input should be greater than or equal to 1",
        ),
        (
            "eval:\n  tasks:\n    - {task_id: a, instructions: x}\n",
            "c.yaml:4: eval.tasks[0].instructions: Extra inputs",
        ),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_config("tasks: t.yaml\n" + text, "c.yaml", tmp_path)
        assert expected in str(err.value), (text, str(err.value))


def test_a_folder_with_evaluations_is_not_trained_over_and_overwrite_removes_them(tmp_path: Path) -> None:
    from polar.cli.train import _start
    from polar.rollout.rundir import RunDirError

    (tmp_path / "t.yaml").write_text("task_id: t\ninstruction: do it\n")
    out = tmp_path / "run"
    out.mkdir()
    config, _ = parse_config(f"tasks: t.yaml\nout: {out}\n", "c.yaml", tmp_path)
    # A run killed during its baseline evaluation: no step yet, one evaluation written.
    (out / "eval.jsonl").write_text('{"step": 0, "eval_accuracy": 0.5}\n')
    with pytest.raises(RunDirError, match=r"already holds a training run \(evaluations in eval\.jsonl\)"):
        _start(config, out, resume_latest=False, overwrite=False)
    _, line = _start(config, out, resume_latest=False, overwrite=True)
    assert "eval.jsonl" in line and not (out / "eval.jsonl").exists()
