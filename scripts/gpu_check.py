"""One-shot check of polar on a machine with a CUDA GPU (scripts/gpu-check): under 10 minutes, a PASS / FAIL /
SKIP line per part, exit status 0 when nothing failed, 1 when something did, 2 without a CUDA device.

Parts, in order (each in its own process, its output in LOGS/PART.log):
    engine     the engine tests that take a device (tests/test_engine_{server,batching,weights,gateway}.py),
               on cuda:0 (POLAR_TEST_DEVICE=cuda; float32, logprobs compared with a forward pass)
    train      `polar train` on the offline tiny model, device cuda, dtype bfloat16, the embedded engine on
               the GPU: 3 steps of packed micro-batches (8 traces packed per row), finite loss and grad norm
    ddp, fsdp  `torchrun --nproc_per_node 2 -m polar train` with NCCL, parallel ddp / fsdp (2 steps);
               skipped with fewer than 2 GPUs (NCCL cannot put two ranks on one device)
    vllm       `vllm serve` of the tiny model with the flags docs/backends.md gives for training, then
               `polar train` against it (2 steps: rollouts through vLLM, weight sync through its RL routes,
               checked by logprobs); skipped when no `vllm` command is on PATH

    scripts/gpu-check                   # every part
    scripts/gpu-check --only train vllm --logs /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("engine", "train", "ddp", "fsdp", "vllm")
BUDGET_S = 570.0  # the whole check, leaving room for start-up under the 10 minutes
PART_LIMIT_S = {"engine": 240.0, "train": 150.0, "ddp": 120.0, "fsdp": 120.0, "vllm": 300.0}
ENGINE_TESTS = ("server", "batching", "weights", "gateway")
NO_CUDA = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check"


@dataclass(frozen=True, slots=True)
class Outcome:
    part: str
    status: str  # PASS | FAIL | SKIP
    detail: str
    seconds: float = 0.0


def summary(outcomes: list[Outcome]) -> tuple[str, int]:
    """The report's lines and the exit status: 1 when a part failed, else 0 (skips are not failures)."""
    lines = [f"{o.status:4}  {o.part:7} {o.seconds:6.1f}s  {o.detail}" for o in outcomes]
    failed = [o.part for o in outcomes if o.status == "FAIL"]
    verdict = f"gpu-check: FAIL ({', '.join(failed)})" if failed else "gpu-check: PASS"
    return "\n".join([*lines, verdict]), 1 if failed else 0


def train_config(device: str, steps: int, backend: str = "embedded", **fields: str) -> str:
    """examples/train.yaml for this check: `steps` steps on `device` in bf16 (8 short traces per step,
    packed into one micro-batch) against `backend`, plus any top-level `fields`."""
    text = (ROOT / "examples" / "train.yaml").read_text()
    for old, new in (
        ("steps: 10", f"steps: {steps}"),
        ("device: cpu", f"device: {device}"),
        ("backend: embedded ", f"backend: {json.dumps(backend)} "),
    ):
        if old not in text:
            raise RuntimeError(f"examples/train.yaml no longer has {old!r}: update scripts/gpu_check.py")
        text = text.replace(old, new)
    head = "".join(f"{k}: {json.dumps(v)}\n" for k, v in {"dtype": "bfloat16", **fields}.items())
    return head + text


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    src = f"{ROOT / 'src'}{os.pathsep}{ROOT}"
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{path}" if path else src, "HF_HUB_OFFLINE": "1"}


def _run(argv: list[str], log: Path, timeout_s: float, cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run `argv` (its output appended to `log`); raise unless it exits 0 within `timeout_s`."""
    with log.open("ab") as sink:
        sink.write(f"$ {' '.join(argv)}\n".encode())
        sink.flush()
        try:
            done = subprocess.run(
                argv, stdout=sink, stderr=subprocess.STDOUT, cwd=cwd, env=env or _env(), timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"exit status {done.returncode}")


def _metrics(out: Path, steps: int) -> str:
    """What a finished `polar train` run wrote: `steps` metric lines with finite loss and grad norm, and
    the last step's checkpoint."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        raise RuntimeError(f"{path} was not written")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(rows) != steps:
        raise RuntimeError(f"{len(rows)} metric lines, expected {steps}")
    for row in rows:
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["traces"] > 0):
            raise RuntimeError(
                f"step {row['step']}: {row['traces']} traces, loss {row['loss']}, "
                f"grad_norm {row['grad_norm']}"
            )
    if not (out / "checkpoints" / f"step-{steps}" / "model.safetensors").is_file():
        raise RuntimeError(f"no checkpoint of step {steps}")
    last = rows[-1]
    return (
        f"{steps} steps; the last: {last['traces']} traces, {last['tokens']} tokens, loss {last['loss']:.4f}, "
        f"grad_norm {last['grad_norm']:.3f}, train {last['train_s']:.1f} s, sync {last['sync_s']:.1f} s"
    )


def _train(
    work: Path,
    log: Path,
    timeout_s: float,
    steps: int,
    launcher: list[str],
    device: str = "cuda",
    **config: str,
) -> str:
    """`polar train` of `steps` steps in `work` (launched by `launcher`), checked by `_metrics`."""
    work.mkdir(parents=True, exist_ok=True)
    if device != "cuda":  # the tests' run on a machine without a GPU: float32
        config.setdefault("dtype", "float32")
    (work / "train.yaml").write_text(train_config(device, steps, **config))
    _run([*launcher, "-m", "polar", "train", "train.yaml", "--set", "out=run"], log, timeout_s, work)
    return _metrics(work / "run", steps)


def part_engine(work: Path, log: Path, timeout_s: float) -> str:
    tests = [f"tests/test_engine_{name}.py" for name in ENGINE_TESTS]
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    _run(argv, log, timeout_s, ROOT, {**_env(), "POLAR_TEST_DEVICE": "cuda"})
    return log.read_text().strip().splitlines()[-1]  # pytest's "N passed in S s"


def part_train(work: Path, log: Path, timeout_s: float) -> str:
    return _train(work, log, timeout_s, 3, [sys.executable])


def part_parallel(parallel: str) -> Callable[[Path, Path, float], str]:
    def run(work: Path, log: Path, timeout_s: float) -> str:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        return _train(work, log, timeout_s, 2, torchrun, parallel=parallel)

    return run


def part_vllm(work: Path, log: Path, timeout_s: float) -> str:
    from tests.vllm_support import SERVED_NAME, start_vllm

    from polar.engine.tiny import default_model_dir

    started = time.monotonic()
    server = start_vllm(
        default_model_dir(),
        work,
        command=shutil.which("vllm"),
        extra=("--gpu-memory-utilization", "0.3"),  # the trainer and its engine share the GPU
        timeout_s=min(240.0, timeout_s),
    )
    try:
        with log.open("a") as sink:
            sink.write(f"vllm serve up in {server.startup_s:.0f} s at {server.url}; its log: {server.log}\n")
        left = timeout_s - (time.monotonic() - started)
        return _train(
            work / "train", log, left, 2, [sys.executable], backend=server.url, served_model=SERVED_NAME
        )
    finally:
        server.stop()


def skip_reason(part: str, gpus: int) -> str | None:
    """Why `part` cannot run on this machine, or None."""
    if part in ("ddp", "fsdp") and gpus < 2:
        return f"{gpus} GPU: NCCL needs a device per rank"
    if part == "vllm" and shutil.which("vllm") is None:
        return "no vllm command on PATH"
    return None


RUNNERS: dict[str, Callable[[Path, Path, float], str]] = {
    "engine": part_engine,
    "train": part_train,
    "ddp": part_parallel("ddp"),
    "fsdp": part_parallel("fsdp"),
    "vllm": part_vllm,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  scripts/gpu-check\n  scripts/gpu-check --only train vllm --logs /tmp/gpu-check",
    )
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run these parts only")
    parser.add_argument(
        "--logs", type=Path, help="folder for each part's log and files (default: a new temp dir)"
    )
    args = parser.parse_args(argv)

    try:
        import torch
    except ImportError:
        print(f"gpu-check: torch is not installed for {sys.executable}; nothing to check")
        return 2
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 2
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    gpus = torch.cuda.device_count()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; logs in {logs}")
    deadline = time.monotonic() + BUDGET_S
    outcomes: list[Outcome] = []
    for part in args.only or PARTS:
        why = skip_reason(part, gpus)
        left = min(PART_LIMIT_S[part], deadline - time.monotonic())
        if why is None and left < 30:
            why = "out of time (the whole check stays under 10 minutes)"
        if why is not None:
            outcomes.append(Outcome(part, "SKIP", why))
            print(f"SKIP  {part}: {why}", flush=True)
            continue
        print(f"....  {part} (at most {left:.0f} s)", flush=True)
        started = time.monotonic()
        log = logs / f"{part}.log"
        try:
            detail, status = RUNNERS[part](logs / part, log, left), "PASS"
        except Exception as exc:  # one part's failure is reported, the next part still runs
            tail = log.read_text(errors="replace").strip().splitlines()[-15:] if log.is_file() else []
            detail, status = f"{exc} (log: {log})" + "".join(f"\n        | {t}" for t in tail), "FAIL"
        outcomes.append(Outcome(part, status, detail, time.monotonic() - started))
        print(f"{status}  {part}", flush=True)
    text, code = summary(outcomes)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
