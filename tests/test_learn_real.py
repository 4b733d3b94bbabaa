"""The real-LM learning run (bench/learn_real.py, docs/learning.md) cut to what proves the stack learns:
Gemma 3 270M from the package index on a real vLLM, rollouts through the gateway by the harness program in the
default (bwrap) sandbox, the first_word evaluator, one GRPO step of `polar train` with full fine-tuning, synced
and verified into the vLLM. Then vLLM itself, on the synced policy, scores every sampled answer again: the
answers it pushed down fell, and the rewarded ones gained on them.

The whole run (held-out accuracy before and after, 9 steps with full fine-tuning and 9 with LoRA, the
trainers' peak memory) is `python bench/learn_real.py`; its 2-step quick run (`--quick`, 10 minutes on 2
cores) is what this test was before it was cut to one step of one mode (docs/testing.md). LoRA's sync into
a real vLLM (the adapter loaded in place, by name) is tests/test_train_loop.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar.rollout.protocol import SessionResult
from polar.trajectory.models import Trajectory
from tests.vllm_support import start_vllm, vllm_command

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "learn_real"
# The training task of the step: base Gemma writes ALERT and stops about a third of the time at temperature 1
# (0.25-0.4 in 32-sample measurements, float32 on an AVX2 CPU), so most groups of 8 hold both rewards. A group
# without (all right or all wrong: ~6%) has no gradient; the step is then taken again on a new group.
TASK = "upper-alert"
GROUP = 8
ATTEMPTS = 4


def _task_file(folder: Path) -> Path:
    """TASK alone, from the example's training tasks, with the files it uploads."""
    folder.mkdir(parents=True)
    for name in ("ask.py", "reward.py", "shots-upper.json", "shots-first.json"):
        shutil.copy(EXAMPLE / name, folder / name)
    lines = (EXAMPLE / "train-tasks.yaml").read_text().splitlines()
    (line,) = [x for x in lines if x.startswith(f'  - {{"task_id": "{TASK}",')]
    (folder / "tasks.yaml").write_text(f"tasks:\n{line}\n")
    return folder / "tasks.yaml"


def _train_one_step(out: Path, sets: list[str]) -> dict[str, Any]:
    """`polar train` for one step, as bench/learn_real.py runs it: the step's metrics line."""
    argv = [sys.executable, "-m", "polar", "train", str(EXAMPLE / "train.yaml")]
    argv += [a for s in [*sets, f"out={out}"] for a in ("--set", s)]
    from bench import learn_real as bench

    log = out.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        env = {**os.environ, **bench.TRAINER_ENV}
        code = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    assert code == 0, log.read_text(errors="replace")[-4000:]
    (line,) = (out / "metrics.jsonl").read_text().splitlines()
    result: dict[str, Any] = json.loads(line)
    return result


def _sampled(out: Path) -> list[tuple[float, list[int], list[int], list[float]]]:
    """Every session of the run: (reward, prompt ids, sampled ids, their logprobs as vLLM sampled them)."""
    import sqlite3

    with sqlite3.connect(out / "server.db") as db:
        rows = db.execute("SELECT result FROM sessions WHERE result IS NOT NULL").fetchall()
    got = []
    for (blob,) in rows:
        result = SessionResult.model_validate_json(blob)
        assert result.reward is not None and result.trajectory is not None, result.reason
        (trace,) = Trajectory.model_validate(result.trajectory).traces
        assert trace.response_logprobs is not None and all(trace.loss_mask)
        got.append((result.reward, trace.prompt_ids, trace.response_ids, trace.response_logprobs))
    return got


def _served_logprobs(http: httpx.Client, model: str, prompt: list[int], response: list[int]) -> list[float]:
    """vLLM's logprobs of `response` after `prompt` under `model` (temperature 1, as sampled)."""
    ids = prompt + response
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"][len(prompt) :]
    return [float(e[str(t)]["logprob"]) for e, t in zip(entries, response, strict=True)]


@pytest.mark.vllm
@pytest.mark.slow
def test_one_step_moves_the_served_policy_toward_the_rewarded_answers(tmp_path: Path) -> None:
    from bench import learn_real as bench

    vllm_command()  # installs the vLLM venv first if this test runs alone
    model = _example("prepare").prepare()  # type: ignore[attr-defined]
    tasks = _task_file(tmp_path / "tasks")
    # bf16 where the CPU has bf16 units, float32 where bf16 is emulated (80x slower; bench.native_bf16).
    dtype = "bfloat16" if bench.native_bf16() else "float32"
    server = start_vllm(
        model, tmp_path, name=bench.SERVED, max_model_len=1024, kv_cache_gib=2, extra=["--dtype", dtype]
    )
    sets = [f"model={model}", f"backend={server.url}", f"served_model={bench.SERVED}", f"tasks={tasks}"]
    sets += ["steps=1", f"group_size={GROUP}", "batch_groups=1", "max_in_flight=1", f"capacity={GROUP}"]
    sets += [f"dtype={dtype}", *bench.MODES["full"]]
    try:
        for attempt in range(1, ATTEMPTS + 1):
            out = tmp_path / f"attempt-{attempt}"
            step = _train_one_step(out, sets)
            assert step["step"] == 1 and step["samples"] == GROUP and step["untrainable_traces"] == 0
            assert step["trainable_tokens"] > 0 and step["sync_s"] > 0  # synced and verified
            if step["zero_variance_groups"] == 0:
                break
        else:
            pytest.fail(f"{ATTEMPTS} groups of {TASK} in a row were all right or all wrong")
        sampled = _sampled(out)
        assert len(sampled) == GROUP
        mean = sum(r for r, *_ in sampled) / GROUP
        # Mean logprob change per answer under the synced weights, rewarded (above the group's mean) or not.
        moved: dict[bool, list[float]] = {True: [], False: []}
        with httpx.Client(base_url=server.url, timeout=300) as http:
            for reward, prompt, response, before in sampled:
                after = _served_logprobs(http, bench.SERVED, prompt, response)
                moved[reward > mean].append(
                    sum(a - b for a, b in zip(after, before, strict=True)) / len(before)
                )
        up, down = (sum(v) / len(v) for v in (moved[True], moved[False]))
        # The answers GRPO pushed down fell, and the rewarded ones gained on them by a clear margin (without
        # a step both move by vLLM's numerical noise, ~0.01). The rewarded ones need not rise outright: one
        # full fine-tuning step moves the tokens both kinds share too (seen: +0.45..-1.9, mean -0.23, while
        # the others fell by 4.8..12 nats per token).
        assert down < 0 and up - down > 0.5, moved
    finally:
        server.stop()


def test_the_bench_tabulates_and_plots_a_summary(tmp_path: Path) -> None:
    """What bench/learn_real.py prints and draws from its runs, on a made-up summary of both modes."""
    from bench import learn_real as bench

    def mode(name: str, after: float) -> dict[str, Any]:
        steps = [
            {"step": s, "reward_mean": 0.25 * s, "train_s": 30.0, "sync_s": 3.0, "rollout_wait_s": 9.0,
             "dropped_stale_groups": s - 1, "filtered_zero_variance_groups": 1}
            for s in (1, 2)
        ]  # fmt: skip
        by_task = {f"{skill}-w{i}": [1.0, 0.0] for skill in ("upper", "first") for i in range(4)}
        better = {k: [after, after] for k in by_task}
        return {
            "mode": name, "steps": steps, "train_s": 60.0, "trainer_peak_rss_gb": 3.0,
            "before": {"by_task": by_task, "errors": 0}, "after": {"by_task": better, "errors": 0},
        }  # fmt: skip

    results = [mode("full", 1.0), mode("lora", 0.0)]
    table = bench.table(results)
    assert "| full | all | 0.500 [0.500, 0.500] | 1.000 [1.000, 1.000] | +0.500 | no |" in table
    assert "| lora | all | 0.500 [0.500, 0.500] | 0.000 [0.000, 0.000] | -0.500 | no |" in table
    assert "| full | 2 | 30.0 | 3.0 | 9.0 | 3.0 | 60 | 0 | 1 | 2 |" in table  # ... dropped, left out
    bench.plot(results, tmp_path / "learning_real.svg")
    assert (tmp_path / "learning_real.svg").read_text().startswith("<?xml")


# -- the run's parts that need no server ----------------------------------------------------------------


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
