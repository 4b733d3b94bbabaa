"""What the dashboard's pages are made of: the token view of a trace (masks, logprob colours, turn starts,
drift, chain breaks, side calls), the tokenizer it decodes with, the stage timeline, the request diff and
a training run's series."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from polar.dashboard import training, views
from polar.dashboard.tokens import load_tokenizer, side_call_ids, trace_tokens

TRACE = {
    "prompt_ids": [10, 11, 12],
    "response_ids": [20, 21, 30, 31, 22],
    "loss_mask": [1, 1, 0, 0, 1],
    "response_logprobs": [-0.01, -2.0, 0.0, 0.0, -9.0],
    "reward": 1.0,
    "metadata": {
        "completion_ids": ["c1", "c2"],
        "turn_offsets": [0, 4],
        "drift_turns": [1],
        "started_by": "context_drift",
    },
}


def test_the_token_view_shows_what_the_trainer_sees() -> None:
    tt = trace_tokens(0, TRACE, None, side_call_ids([{"completion_id": "c2", "tags": ["side_call"]}]))
    assert [t.kind for t in tt.tokens] == ["prompt"] * 3 + [
        "trainable",
        "trainable",
        "masked",
        "masked",
        "trainable",
    ]
    assert [t.text for t in tt.tokens] == [
        "10",
        "11",
        "12",
        "20",
        "21",
        "30",
        "31",
        "22",
    ]  # ids: no tokenizer
    assert [t.band for t in tt.tokens if t.kind == "trainable"] == ["lp0", "lp3", "lp4"]
    assert all(t.logprob is None for t in tt.tokens if t.kind != "trainable")  # masked: no logprob shown
    assert [(t.id, t.turn, t.drift) for t in tt.tokens if t.turn is not None] == [
        (20, 0, False),
        (22, 1, True),
    ]
    assert "logprob -9.000" in tt.tokens[-1].title and "context drift" in tt.tokens[-1].title
    assert tt.side_call and tt.started_by == "context_drift" and tt.trainable == 3 and not tt.has_text


def test_a_trace_without_logprobs_or_side_calls() -> None:
    tt = trace_tokens(1, {**TRACE, "response_logprobs": None}, None, set())
    assert not tt.side_call
    assert all(t.logprob is None and t.band == "" for t in tt.tokens)


def test_token_text_comes_from_the_policys_tokenizer_offline() -> None:
    from transformers import AutoTokenizer

    from polar.engine.tiny import default_model_dir

    folder = str(default_model_dir())
    ids = AutoTokenizer.from_pretrained(folder).encode("def add(a, b):\n    return a + b")
    decode = load_tokenizer(folder)
    tt = trace_tokens(0, {**TRACE, "prompt_ids": ids, "response_ids": [], "loss_mask": [],
                          "response_logprobs": []}, decode, set())  # fmt: skip
    assert "".join(t.text for t in tt.tokens) == "def add(a, b):\n    return a + b" and tt.has_text


def test_a_tokenizer_that_is_not_here_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "tasks.yaml").write_text("tasks:\n  - task_id: a\n    instruction: x\n")
    proc = subprocess.run(
        [sys.executable, "-m", "polar", "run", str(tmp_path / "tasks.yaml"), "--backend", "http://127.0.0.1:9",
         "--tokenizer", str(tmp_path / "no-such-tokenizer")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--tokenizer" in proc.stderr and "Traceback" not in proc.stderr


def test_the_timeline_places_stages_on_one_axis() -> None:
    bars = views.timeline({"queued_s": 1.0, "init_s": 1.0, "run_s": 2.0, "post_s": 0.0, "total_s": 4.0})
    assert [(b.label, b.start_pct, b.width_pct) for b in bars] == [
        ("queue", 0.0, 25.0), ("init", 25.0, 25.0), ("run", 50.0, 50.0), ("postrun", 100.0, 0.3),
    ]  # fmt: skip


def test_the_request_diff_marks_what_the_gateway_changed() -> None:
    lines = views.diff_lines({"model": "a", "stream": True}, {"model": "a", "logprobs": True})
    assert ("del", '-  "stream": true') in lines and ("add", '+  "logprobs": true,') in lines


def test_a_training_run_with_a_torn_last_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"step":1,"policy_version":1,"reward_mean":0.25,"pass_rate":null}\n'
        '{"step":2,"policy_version":2,"reward_mean":0.5,"pass_rate":0.5}\n{"step":3,"rew'
    )
    run = training.read_run(tmp_path)
    assert run.steps == [1, 2] and run.skipped == 1
    assert run.series["reward_mean"] == [0.25, 0.5] and run.series["pass_rate"] == [None, 0.5]
    assert [c["title"] for c in run.charts()] == ["reward", "pass rate", "policy version"]
    assert training.read_run(tmp_path / "nope" / "deeper").error is not None
    assert training.read_run(tmp_path / "nope").steps == []  # no step yet: not an error


def test_the_reward_chart_draws_mean_plus_minus_std_as_a_band(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"step":1,"reward_mean":0.5,"reward_std":0.5}\n{"step":2,"reward_mean":0.75,"reward_std":null}\n'
    )
    reward = training.read_run(tmp_path).charts()[0]
    assert reward["title"] == "reward" and reward["band"] == ["mean + std", "mean - std"]
    assert reward["series"] == {
        "reward_mean": [0.5, 0.75], "mean + std": [1.0, None], "mean - std": [0.0, None],
    }  # fmt: skip
