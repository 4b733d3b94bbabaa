"""Data-parallel training under torchrun (polar.train.distributed): two processes on CPU with gloo take the
same optimizer step as one process on the whole batch, with DDP and with FSDP2 (`fully_shard`, which runs
on CPU with gloo in torch 2.13).

A script started by `torchrun --standalone --nproc_per_node 2` builds the toy Qwen3 of the training tests and a
fixed batch of traces of different lengths; rank 0 steps on it (splitting it over the ranks), rank 1 serves.
The same step in this process, without torchrun, must give the same weights (to float32 rounding of the
gradient sums), loss, token counts and gradient norm — with several micro-batches of different counts per
rank, with either loss aggregation, and with a batch of one trace (the other rank joins with a dummy).
Under FSDP rank 0 also gathers the weights, scores a text and writes a checkpoint, which needs rank 1 too:
the checkpoint is an ordinary Hugging Face folder with the single-process weights, and its optimizer state
resumes a trainer that is not sharded.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from polar.train import distributed
from polar.train.loss import LossConfig
from polar.train.trainer import OptimizerConfig, Sample, Trainer, TrainerConfig
from tests.train_support import tiny_lm

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, sys, torch
from pathlib import Path
from polar.train import distributed
from tests.test_train_distributed import PROBE, batch, config, make, real_tokenizer
out, aggregation, micro, n, parallel, kl = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], float(sys.argv[6])
world = distributed.from_env()
trainer = make(config(aggregation, micro, parallel, kl), world)
if world.leader:
    r = trainer.step(batch(n))
    torch.save({k: v.clone() for k, v in trainer.state_dict().items()}, out + "/weights.pt")
    probe = trainer.logprobs(*PROBE)
    if parallel == "fsdp":
        trainer.tokenizer = real_tokenizer()
        trainer.save(Path(out) / "checkpoint")
    trainer.close()
    json.dump({"loss": r.loss, "tokens": r.tokens, "traces": r.traces, "grad_norm": r.grad_norm,
               "trainable": r.metrics.tokens, "logprob_diff": r.logprob_diff, "probe": probe},
              open(out + "/result.json", "w"))
else:
    trainer.serve()
distributed.leave()
distributed.end_process()
"""
PROBE = ([5, 9, 2], [7, 7, 30, 1])


class _Tok:
    pad_token_id = 0


def config(aggregation: str, micro: int, parallel: str = "ddp", kl: float = 0.0) -> TrainerConfig:
    return TrainerConfig(
        loss=LossConfig(aggregation=aggregation, kl_coef=kl),  # type: ignore[arg-type]
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1, grad_clip=1.0),
        micro_batch_tokens=micro,
        device="cpu",
        dtype="float32",
        parallel=parallel,
    )


def real_tokenizer() -> Any:
    """The offline tiny model's tokenizer (Qwen3's): `save` writes it next to the weights."""
    from transformers import AutoTokenizer

    from polar.train.trainer import model_source

    return AutoTokenizer.from_pretrained(model_source(None))


def make(cfg: TrainerConfig, world: distributed.World | None = None) -> Trainer:
    return Trainer(tiny_lm(), _Tok(), cfg, world)


def batch(n: int) -> list[Sample]:
    rng = random.Random(7)
    out = []
    for _ in range(n):
        p, r = rng.randint(3, 20), rng.randint(2, 16)
        mask = [rng.choice((0, 1, 1)) for _ in range(r)]
        out.append(
            Sample(
                [rng.randrange(1, 64) for _ in range(p)],
                [rng.randrange(1, 64) for _ in range(r)],
                mask,
                [-rng.uniform(0.1, 3.0) for _ in range(r)],
                rng.uniform(-1, 1),
                rng.uniform(0.5, 1.5),
            )
        )
    return out


def test_shards_balance_tokens_and_keep_every_trace_once() -> None:
    lengths = [30, 5, 12, 12, 40, 1, 7]
    plan = distributed.shard(lengths, 3)
    assert sorted(i for idx in plan for i in idx) == list(range(7))
    loads = [sum(lengths[i] for i in idx) for idx in plan]
    assert max(loads) - min(loads) <= max(lengths)
    assert distributed.shard([3], 2) == [[0], []]  # a rank may get nothing (it joins with a dummy)


@pytest.mark.slow  # two torchrun ranks each load torch and train the tiny model: 15-30 s apiece
@pytest.mark.parametrize(
    ("aggregation", "micro", "n", "parallel", "kl"),
    [
        ("token_mean", 24, 9, "ddp", 0.0),
        ("sequence_mean", 4096, 9, "ddp", 0.0),
        ("token_mean", 24, 1, "ddp", 0.0),
        # FSDP: uneven micro-batch counts (the rank with fewer runs padding ones) and a sharded KL reference
        ("token_mean", 24, 9, "fsdp", 0.05),
        ("token_mean", 24, 1, "fsdp", 0.0),
    ],
)
def test_two_ranks_take_the_single_process_step(
    tmp_path: Path, aggregation: str, micro: int, n: int, parallel: str, kl: float
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    script = tmp_path / "dp_step.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*argv, str(script), str(tmp_path), aggregation, str(micro), str(n), parallel, str(kl)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    weights = torch.load(tmp_path / "weights.pt")
    got = json.loads((tmp_path / "result.json").read_text())

    single = make(config(aggregation, micro, parallel, kl))
    before = {k: v.detach().clone() for k, v in single.model.state_dict().items()}
    r = single.step(batch(n))
    after = single.model.state_dict()
    moved = max(float((after[k] - before[k]).abs().max()) for k in after)
    assert moved > 1e-4  # the step changed the weights (lr 1e-2), so equality below is not vacuous
    worst = max(float((after[k] - weights[k]).abs().max()) for k in after)
    assert worst < 1e-5, worst
    assert (got["tokens"], got["traces"], got["trainable"]) == (r.tokens, r.traces, r.metrics.tokens)
    assert got["loss"] == pytest.approx(r.loss, rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(r.grad_norm, rel=1e-5)
    assert got["logprob_diff"] == pytest.approx(r.logprob_diff, rel=1e-5)
    assert got["probe"] == pytest.approx(single.logprobs(*PROBE), rel=1e-5, abs=1e-6)
    if parallel == "fsdp":
        from transformers import AutoModelForCausalLM

        folder = tmp_path / "checkpoint"
        arch = json.loads((folder / "config.json").read_text())["architectures"]
        assert arch == ["Qwen3ForCausalLM"]  # not FSDP's wrapper class: vLLM and the engine load it
        loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert max(float((after[k] - loaded[k]).abs().max()) for k in after) < 1e-5
        resumed = Trainer(AutoModelForCausalLM.from_pretrained(folder), _Tok(), config(aggregation, micro))
        resumed.restore(folder)
        assert resumed.step_count == 1
        want, have = single.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
        assert len(have) == len(want) > 0
        for i in want:
            assert torch.allclose(have[i]["exp_avg_sq"], want[i]["exp_avg_sq"], rtol=1e-4, atol=1e-12)


@pytest.mark.slow  # the whole `polar train` under torchrun, two ranks training
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_polar_train_runs_under_torchrun(tmp_path: Path, parallel: str) -> None:
    """`torchrun --nproc_per_node 2 -m polar train`: rank 0 runs the rollouts, the loop and the out folder;
    rank 1 steps on its shards and writes nothing. Under FSDP rank 1 also takes part in each weight sync
    into the embedded engine and in the checkpoint, which must be an ordinary Hugging Face folder."""
    config = (ROOT / "examples" / "train.yaml").read_text().replace("steps: 10", "steps: 1")
    (tmp_path / "train.yaml").write_text(f"parallel: {parallel}\n{config}")
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",  # this tree's polar, not an installed one
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        # Weight decay at this lr moves every weight even when no group of the step has a reward spread
        # (the offline tiny policy's rewards are chance): "trained" must not depend on that chance.
        [
            *argv,
            "-m",
            "polar",
            "train",
            "train.yaml",
            "--set",
            "out=run",
            "--set",
            "optimizer.lr=1e-2",
            "--set",
            "optimizer.weight_decay=0.1",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 1
    assert done.stdout.count("new run in run") == 1  # only rank 0 prepared the out folder
    checkpoint = tmp_path / "run" / "checkpoints" / "step-1"
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    from safetensors.torch import load_file

    from polar.train.trainer import model_source

    weights = load_file(checkpoint / "model.safetensors")
    initial = load_file(Path(model_source(None)) / "model.safetensors")
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in initial.items()}  # unsharded
    assert any(not torch.equal(weights[k], initial[k]) for k in initial)  # and trained
