"""`polar train CONFIG` as a user runs it: a subprocess, the tiny model on CPU, the example's task."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import torch
import yaml

from polar.train.config import ConfigError, load_config, parse_config
from tests.extras_support import one_line_error, polar_without
from tests.server_support import interruptible

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.yaml"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


def polar(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polar", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def small_config(tmp_path: Path, **overrides: object) -> Path:
    """The shipped example, shrunk: one step on one group of two samples."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data.update({"steps": 1, "group_size": 2, "batch_groups": 1, "out": str(tmp_path / "run"), **overrides})
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_example_config_is_valid() -> None:
    config, tasks = load_config(EXAMPLE)
    assert config.model is None and config.backend == "embedded" and config.device == "cpu"
    assert [t.task_id for t in tasks] == ["short-answer"] and tasks[0].agent.harness == "shell"


@pytest.mark.slow  # loads the tiny model and runs the whole stack
def test_train_writes_metrics_and_a_loadable_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    proc = polar("train", str(small_config(tmp_path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "run"
    lines = [orjson.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines()]
    assert len(lines) == 1
    line = lines[0]
    assert line["step"] == 1 and line["policy_version"] == 1 and 0.0 <= line["reward_mean"] <= 1.0
    assert line["samples"] == 2 and line["tokens"] > line["trainable_tokens"] > 0
    for key in (
        "pass_rate",
        "staleness_mean",
        "clip_fraction",
        "kl",
        "loss",
        "rollout_wait_s",
        "train_s",
        "sync_s",
    ):
        assert isinstance(line[key], int | float), key
    folder = run / "checkpoints" / "step-1"
    assert (folder / "optimizer.pt").is_file() and (folder / "trainer_state.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "qwen3"
    assert (run / "gateway.db").is_file()
    assert "step    1" in proc.stdout and "policy version 1" in proc.stdout


@pytest.mark.slow  # loads the tiny model and runs the whole stack
def test_train_with_render_gateway_trains_on_the_gateways_token_chains(tmp_path: Path) -> None:
    """`render: gateway` end to end: the gateway renders every rollout's prompt itself (token ids to the
    embedded engine), two steps with a weight sync between them train on those ids, one trace a session,
    and the trainer's log-probabilities of the sampled tokens match the engine's."""
    import contextlib
    import sqlite3

    proc = polar("train", str(small_config(tmp_path, render="gateway", steps=2)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "run"
    lines = [orjson.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines()]
    assert [line["policy_version"] for line in lines] == [1, 2]
    for line in lines:
        assert line["traces"] == line["samples"] == 2 and line["trainable_tokens"] > 0
        assert line["logprob_diff"] < 1e-3, line  # the ids trained on are the ones the engine sampled
    with contextlib.closing(sqlite3.connect(run / "gateway.db")) as db:
        flags = [orjson.loads(f) for (f,) in db.execute("SELECT flags FROM completions")]
    assert len(flags) >= 4 and all("render:gateway" in f for f in flags)


def test_a_bad_config_points_at_the_line(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("tasks: tasks.yaml\nsteps: 3\noptimizer:\n  lr: 0\n")
    proc = polar("train", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{path}:4: optimizer.lr: Input should be greater than 0" in proc.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tasks: []\n", "cfg.yaml:1: tasks: must be a task file"),
        (
            "tasks: t.yaml\nestimator: ppo\n",
            "cfg.yaml:2: estimator: Input should be 'grpo', 'rloo' or 'dr_grpo'",
        ),
        ("tasks: t.yaml\nbackend: ftp://x\n", "cfg.yaml:2: backend: must be 'embedded', or an http(s) URL"),
        ("tasks: t.yaml\nloss:\n  aggregation: sum\n", "cfg.yaml:3: loss.aggregation: Input should be"),
        (
            "tasks: t.yaml\nsteps: 2\nlearning_rate: 1\n",
            "cfg.yaml:3: learning_rate: Extra inputs are not permitted",
        ),
        ("tasks: t.yaml\n  steps: [\n", "cfg.yaml:2: not valid YAML"),
        ("- 1\n", "cfg.yaml: expected a mapping"),
        (
            "tasks:\n  - task_id: a\n    instruction: x\n    runtime:\n      backend: vm\n",
            "cfg.yaml:5: tasks[0].runtime.backend: Input should be",
        ),
        (
            "tasks:\n  - {task_id: a, instruction: x}\n  - {task_id: a, instruction: y}\n",
            "duplicate task_id a",
        ),
        ("tasks: missing.yaml\n", "cfg.yaml:1: tasks: "),
    ],
)
def test_config_errors_name_the_line_and_field(tmp_path: Path, text: str, expected: str) -> None:
    (tmp_path / "t.yaml").write_text("task_id: t\ninstruction: do it\n")
    with pytest.raises(ConfigError) as err:
        parse_config(text, "cfg.yaml", tmp_path)
    assert expected in str(err.value)


def test_task_file_and_inline_uploads_are_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("task_id: t\ninstruction: do it\nnum_samples: 3\n")
    config, tasks = parse_config("tasks: t.yaml\ngroup_size: 2\n", "cfg.yaml", tmp_path)
    assert config.group_size == 2 and tasks[0].task_id == "t" and config.in_flight == 4
    inline = "tasks:\n  - task_id: u\n    instruction: x\n    runtime:\n      prepare:\n        - {type: upload, src: repo}\n"
    with pytest.raises(
        ConfigError, match=r"cfg.yaml:6: tasks\[0\].runtime.prepare\[0\].src: 'repo': no such"
    ):
        parse_config(inline, "cfg.yaml", tmp_path)  # was: every session ERROR once training started
    (tmp_path / "repo").mkdir()
    _, tasks = parse_config(inline, "cfg.yaml", tmp_path)
    assert tasks[0].runtime.prepare[0].src == str(tmp_path / "repo")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("blocked", "sets", "expected"),
    [
        (("tensorboard",), ("metrics.tensorboard=true",), "metrics.tensorboard: true needs tensorboard"),
        (("wandb",), ("metrics.wandb=true",), "metrics.wandb: true needs wandb"),
        (("torch",), (), "polar train needs torch"),
    ],
    ids=["tensorboard", "wandb", "torch"],
)
def test_a_missing_optional_package_fails_before_training(
    tmp_path: Path, blocked: tuple[str, ...], sets: tuple[str, ...], expected: str
) -> None:
    """A feature the config turns on whose package cannot be imported: one line naming the extra to
    install, exit 2, before anything starts (nothing is written under `out`)."""
    extra = {"tensorboard": "tensorboard", "wandb": "wandb", "torch": "engine"}[blocked[0]]
    overrides = [arg for s in sets for arg in ("--set", s)]
    proc = polar_without(blocked, "train", str(small_config(tmp_path)), *overrides)
    line = one_line_error(proc)
    assert expected in line and f"pip install 'polar-rl[{extra}]'" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # loads the tiny model and runs the whole stack
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_metrics_when_installed(tmp_path: Path) -> None:
    proc = polar("train", str(small_config(tmp_path, metrics={"tensorboard": True})))
    assert proc.returncode == 0, proc.stderr
    assert any((tmp_path / "run" / "tensorboard").iterdir())


@pytest.mark.slow  # loads the tiny model and runs the whole stack
def test_resume_continues_the_step_count_and_optimizer(tmp_path: Path) -> None:
    first = polar("train", str(small_config(tmp_path)))
    assert first.returncode == 0, first.stderr
    step1 = tmp_path / "run" / "checkpoints" / "step-1"
    again = polar("train", str(small_config(tmp_path, steps=2, resume=str(step1))))
    assert again.returncode == 0, again.stdout + again.stderr
    lines = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    assert [(m["step"], m["policy_version"]) for m in lines] == [(1, 1), (2, 2)]  # appended, not restarted
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
    assert all(int(s["step"]) == 2 for s in state["state"].values())  # Adam's moments carried over

    missing = polar("train", str(small_config(tmp_path, resume=str(tmp_path / "nowhere"))))
    assert missing.returncode == 2 and "is not a checkpoint written by polar train" in missing.stderr


def fake_earlier_run(run: Path, steps: int, checkpoint: int | None) -> bytes:
    """What an earlier `polar train` leaves in `out`: metrics lines and a checkpoint folder."""
    run.mkdir(parents=True)
    metrics = b"".join(orjson.dumps({"step": s, "policy_version": s}) + b"\n" for s in range(1, steps + 1))
    (run / "metrics.jsonl").write_bytes(metrics)
    if checkpoint is not None:
        folder = run / "checkpoints" / f"step-{checkpoint}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
    return metrics


def test_an_earlier_run_in_out_is_never_trained_over_silently(tmp_path: Path) -> None:
    metrics = fake_earlier_run(tmp_path / "run", steps=3, checkpoint=2)
    proc = polar("train", str(small_config(tmp_path)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "already holds a training run (3 steps in metrics.jsonl, last checkpoint checkpoints/step-2)" in (
        proc.stderr
    )
    assert "--resume" in proc.stderr and "--overwrite" in proc.stderr
    both = polar("train", str(small_config(tmp_path)), "--resume", "--overwrite")
    assert both.returncode == 2 and "give one" in both.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics


def test_resume_needs_a_checkpoint(tmp_path: Path) -> None:
    fake_earlier_run(tmp_path / "run", steps=1, checkpoint=None)
    proc = polar("train", str(small_config(tmp_path)), "--resume")
    assert proc.returncode == 2 and "has no checkpoint to continue from" in proc.stderr


@pytest.mark.slow  # loads the tiny model and runs the whole stack, three times
def test_resume_flag_continues_and_overwrite_replaces(tmp_path: Path) -> None:
    first = polar("train", str(small_config(tmp_path)))
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"new run in {tmp_path / 'run'}" in first.stdout
    metrics = tmp_path / "run" / "metrics.jsonl"
    kept = metrics.read_bytes()
    resumed = polar("train", str(small_config(tmp_path)), "--resume", "--steps", "2")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / 'step-1'}" in resumed.stdout
    assert metrics.read_bytes().startswith(kept)
    assert [orjson.loads(line)["step"] for line in metrics.read_bytes().splitlines()] == [1, 2]
    replaced = polar("train", str(small_config(tmp_path)), "--overwrite")
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    assert "overwrote" in replaced.stdout and "removed metrics.jsonl, checkpoints" in replaced.stdout
    assert [orjson.loads(line)["step"] for line in metrics.read_bytes().splitlines()] == [1]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-1"]


@pytest.mark.slow  # loads the tiny model and trains until interrupted
def test_ctrl_c_keeps_the_finished_steps_and_exits_130(tmp_path: Path) -> None:
    config = small_config(tmp_path, steps=1000, checkpoint_every=1)
    metrics = tmp_path / "run" / "metrics.jsonl"
    argv = [sys.executable, "-m", "polar", "train", str(config)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=interruptible
    )
    try:
        deadline = time.monotonic() + 600
        while not (metrics.is_file() and metrics.read_bytes().count(b"\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "Aborted" not in out + err
    steps = [orjson.loads(line)["step"] for line in metrics.read_bytes().splitlines()]
    assert steps and steps == list(range(1, len(steps) + 1))
    assert f"interrupted: rollouts in flight were cancelled; {len(steps)} step(s) of 1000 recorded" in out
    assert "continue with the same command and --resume" in out
