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
        # A generous bound: the run picks float32 on a CPU without bf16 units (bench/learn_real.native_bf16),
        # where bf16 autocast once made it pass 30 minutes.
        timeout=2400,
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
            assert r[when]["errors"] == 0 and len(scored) == 16 and set(scored) <= {0.0, 1.0}
    # LoRA trains a few adapters: its trainer needs less memory than full fine-tuning's.
    assert results[1]["trainer_peak_rss_gb"] < results[0]["trainer_peak_rss_gb"]
    table = (out / "table.md").read_text()
    assert "| full | all |" in table and "| lora | all |" in table
    assert (out / "learning_real.svg").read_text().startswith("<?xml")


# -- the run's parts that need no server ----------------------------------------------------------------

EXAMPLE = ROOT / "examples" / "learn_real"


def _example(name: str) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"learn_real_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_task_files_are_what_the_generator_writes_and_held_out_words_are_never_trained(
    tmp_path: Path,
) -> None:
    import yaml

    _example("tasks").main(tmp_path)  # type: ignore[attr-defined]
    for name in ("train-tasks.yaml", "heldout-tasks.yaml", "shots-upper.json", "shots-first.json"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), name
    train = yaml.safe_load((EXAMPLE / "train-tasks.yaml").read_text())["tasks"]
    held = yaml.safe_load((EXAMPLE / "heldout-tasks.yaml").read_text())["tasks"]
    train_words = {t["metadata"]["word"] for t in train}
    held_words = {t["metadata"]["word"] for t in held}
    assert len(train_words) == 255 and len(held_words) == 110 and not train_words & held_words
    assert not {"apple", "river"} & (train_words | held_words)  # the worked examples are never asked


@pytest.mark.parametrize(
    ("reply", "answer", "right"),
    [
        ("HARBOR", "HARBOR", True),
        ("HARBOR\nmore text", "HARBOR", True),
        ('"HARBOR".', "HARBOR", True),
        ("HARBORをする\nあなたへ", "HARBOR", False),  # seen from the untrained model: no word boundary
        ("HARBORside", "HARBOR", False),
        ("Harbor", "HARBOR", False),
        ("The answer is HARBOR", "HARBOR", False),
        ("", "h", False),
        ("h\n", "h", True),
    ],
)
def test_first_word_is_the_answer_only_as_a_whole_word(reply: str, answer: str, right: bool) -> None:
    assert (_example("reward").first_word(reply) == answer) is right  # type: ignore[attr-defined]


def test_the_chat_template_is_gemmas_turn_format() -> None:
    import jinja2

    template = jinja2.Environment().from_string(_example("prepare").CHAT_TEMPLATE)  # type: ignore[attr-defined]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"},
    ]
    text = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n"
    )
