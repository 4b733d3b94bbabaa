"""scripts/gpu-check, as far as it runs without a GPU: the one-line refusal (exit 2), the summary's verdict,
the parts it skips and why, the training config it writes (valid for `polar train`), and its train part's
run and checks of `polar train`'s output, on the CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _module()


def test_without_cuda_it_says_so_in_one_line_and_exits_2() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2
    assert done.stdout.splitlines() == [gpu_check.NO_CUDA] and "CUDA" in done.stdout


def test_the_summary_fails_on_a_failed_part_and_not_on_a_skip() -> None:
    outcome = gpu_check.Outcome
    text, code = gpu_check.summary(
        [outcome("engine", "PASS", "9 passed", 12.0), outcome("ddp", "SKIP", "1 GPU")]
    )
    assert code == 0 and text.splitlines()[-1] == "gpu-check: PASS"
    assert text.splitlines()[0].startswith("PASS  engine")
    text, code = gpu_check.summary([outcome("train", "FAIL", "exit status 1"), outcome("vllm", "PASS", "")])
    assert code == 1 and text.splitlines()[-1] == "gpu-check: FAIL (train)"


def test_parts_that_cannot_run_here_are_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no vllm on it
    assert "NCCL" in (gpu_check.skip_reason("fsdp", 1) or "")
    assert gpu_check.skip_reason("ddp", 2) is None
    assert gpu_check.skip_reason("vllm", 8) == "no vllm command on PATH"
    (tmp_path / "vllm").write_text("#!/bin/sh\n")
    (tmp_path / "vllm").chmod(0o755)
    assert gpu_check.skip_reason("vllm", 1) is None


def test_the_config_it_trains_with_is_valid(tmp_path: Path) -> None:
    from polar.train.config import load_config

    path = tmp_path / "train.yaml"
    path.write_text(
        gpu_check.train_config(
            "cuda", 2, backend="http://127.0.0.1:8000", served_model="tiny", parallel="fsdp"
        )
    )
    config, tasks = load_config(path)
    assert (config.device, config.dtype, config.steps, config.parallel) == ("cuda", "bfloat16", 2, "fsdp")
    assert (config.backend, config.served_model) == ("http://127.0.0.1:8000", "tiny")
    assert config.group_size * config.batch_groups > 1 and len(tasks) == 1  # several traces to pack


@pytest.mark.slow  # loads the tiny model and trains a step through `polar train`
def test_its_train_part_runs_polar_train_and_checks_what_it_wrote(tmp_path: Path) -> None:
    """The train part's own code path, on the CPU in float32 (1 step): `polar train` through the CLI, then
    the metric lines, their figures and the checkpoint it expects."""
    log = tmp_path / "train.log"
    detail = gpu_check._train(tmp_path / "work", log, 300.0, 1, [sys.executable], device="cpu")
    assert detail.startswith("1 steps; the last: ") and "loss" in detail, detail
    with pytest.raises(RuntimeError, match="1 metric lines, expected 2"):
        gpu_check._metrics(tmp_path / "work" / "run", 2)
