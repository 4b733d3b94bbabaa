"""The real-LM learning run (bench/learn_real.py, docs/learning.md) in its CI length: Gemma 3 270M from the
package index, a real vLLM, the gateway, the harness program in a local sandbox, the first_word evaluator,
two GRPO steps with full fine-tuning and two with LoRA, weights synced and verified into vLLM after each,
and the held-out evaluation before and after. The whole run, not its parts: the parts have their own tests.

What it checks is that every part did its job on the real model (no sync failed its logprob check, every
session was scored, the steps trained on sampled tokens); whether the policy got better is what the full
run measures (docs/learning.md), two steps cannot show it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_support import vllm_command

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent


def test_the_short_run_trains_both_modes_through_the_real_stack(tmp_path: Path) -> None:
    vllm_command()  # installs the vLLM venv first if this test runs alone
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "learn_real.py"), "--out", str(out), "--quick"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((out / "summary.json").read_text())
    assert [r["mode"] for r in results] == ["full", "lora"]
    for r in results:
        assert [s["step"] for s in r["steps"]] == [1, 2]
        for s in r["steps"]:
            assert s["samples"] == 8 and s["trainable_tokens"] > 0 and s["untrainable_traces"] == 0
            assert s["sync_s"] > 0  # synced (a failed logprob check would have stopped the run)
        for when in ("before", "after"):
            scored = [x for xs in r[when]["by_task"].values() for x in xs]
            assert r[when]["errors"] == 0 and len(scored) == 48 and set(scored) <= {0.0, 1.0}
    # LoRA trains a few adapters: its trainer needs less memory than full fine-tuning's.
    assert results[1]["trainer_peak_rss_gb"] < results[0]["trainer_peak_rss_gb"]
    table = (out / "table.md").read_text()
    assert "| full | all |" in table and "| lora | all |" in table
    assert (out / "learning_real.svg").read_text().startswith("<?xml")
