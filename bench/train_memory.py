"""The trainer's resident memory over steps, with glibc's allocator as it comes and as polar sets it.

    python bench/train_memory.py                      # Gemma 3 270M, full fine-tuning, 6 steps per mode
    python bench/train_memory.py --steps 3 --json out.json

Each mode runs in a fresh process: the reference trainer (polar.train.trainer) on the real Gemma 3 270M
(examples/learn_real/prepare.py), bf16 autocast on the CPU, float32 weights and AdamW, 32 traces of
learn_real's shape (120-180 prompt tokens, 2-20 response tokens) per step, each step and weight save in a
worker thread as `polar train` runs them (`asyncio.to_thread`). After every step it reads the process's
RSS. Modes:

- `glibc`: the allocator as it comes (what polar did before polar.train.memory);
- `arenas`: only `mallopt(M_ARENA_MAX, 2)`;
- `polar`: what `polar train` does: two arenas and `malloc_trim` after each step and save.

Prints RSS after each step, the peak, and the median step time, side by side; docs/benchmarks.md has a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("glibc", "arenas", "polar")

CHILD = r"""
import asyncio, json, os, random, resource, sys, tempfile, time
from pathlib import Path
import torch
from polar.train import memory
from polar.train import trainer as trainer_mod
from polar.train.loss import LossConfig
from polar.train.trainer import OptimizerConfig, Sample, Trainer, TrainerConfig

mode, model, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode != "polar":
    trainer_mod.memory.trim = lambda: False  # the trainer's calls become no-ops: glibc as it comes
if mode in ("arenas", "polar"):
    assert memory.limit_arenas(), "MALLOC_ARENA_MAX is set, or this is not glibc"

def rss_gb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1e6

cfg = TrainerConfig(model=model, loss=LossConfig(eps_low=0.2, eps_high=0.28, tis_cap=2.0),
    optimizer=OptimizerConfig(3e-5, 0.0), micro_batch_tokens=2048, dtype="bfloat16", device="cpu")
trainer = Trainer.load(cfg)
rng = random.Random(0)
out = {"rss_gb": [], "step_s": []}
with tempfile.TemporaryDirectory() as tmp:
    for step in range(steps):
        samples = []
        for _ in range(32):
            p = [rng.randrange(1000, 20000) for _ in range(rng.randrange(120, 180))]
            r = [rng.randrange(1000, 20000) for _ in range(rng.randrange(2, 20))]
            samples.append(Sample(p, r, [1] * len(r), [-1.0] * len(r), rng.uniform(-1, 1), 1.0))
        started = time.perf_counter()
        asyncio.run(asyncio.to_thread(trainer.step, samples))
        out["step_s"].append(time.perf_counter() - started)
        asyncio.run(asyncio.to_thread(trainer.save_weights, Path(tmp) / "weights"))
        out["rss_gb"].append(rss_gb())
        print(f"  {mode} step {step + 1}: {out['rss_gb'][-1]:.2f} GB", file=sys.stderr, flush=True)
out["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print(json.dumps(out))
"""


def run_mode(mode: str, model: Path, steps: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(model), str(steps)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        check=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6, help="Optimizer steps per mode (default 6).")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--model", type=Path, default=None, help="A model folder (default: prepare.py's).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    args = parser.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "examples" / "learn_real"))
        from prepare import prepare  # examples/learn_real/prepare.py

        model = prepare()
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        print(f"{mode}: {args.steps} steps", file=sys.stderr, flush=True)
        results[mode] = run_mode(mode, model, args.steps)
    steps = range(args.steps)
    print(
        "| mode | " + " | ".join(f"RSS after step {i + 1}" for i in steps) + " | peak | step time (median) |"
    )
    print("|---|" + "---:|" * (args.steps + 2))
    for mode, r in results.items():
        rss = " | ".join(f"{v:.1f} GB" for v in r["rss_gb"])
        print(f"| {mode} | {rss} | {r['peak_gb']:.1f} GB | {statistics.median(r['step_s']):.0f} s |")
    if "glibc" in results and "polar" in results:
        ratio = results["glibc"]["rss_gb"][-1] / results["polar"]["rss_gb"][-1]
        print(f"\nRSS after the last step, glibc / polar: {ratio:.1f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"steps": args.steps, "modes": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
