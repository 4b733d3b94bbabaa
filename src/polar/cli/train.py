"""`polar train CONFIG`: GRPO on this machine, rollouts through the rollout service, any harness.

It starts the policy server (the embedded engine, or uses the vLLM server the config names), the rollout
server and a gateway node, then trains: task groups run while the policy trains, each step's weights are
synced to the policy server between a gateway pause and resume. See `polar.train.config` for the file
and `--set` overrides (docs/reference/train-config.md lists every field).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from polar import interrupt
from polar.cli.common import logging_options, setup_logging
from polar.cli.run import _console
from polar.rollout.rundir import TRAIN_FILES, RunDirError, checkpoints, locked, metrics_steps, remove

if TYPE_CHECKING:
    from polar.train.config import TrainConfig


class BadOverride(click.ClickException):
    """A bad --set/--out/--steps: one line on stderr, exit status 2 (click's status for usage errors)."""

    exit_code = 2


@click.command("train")
@click.argument("config", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Set any config field by its dotted path (repeatable, later wins). VALUE is read as YAML: "
    "0.3, 2e-6, true, null, [0.9, 0.95], other.yaml.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Same as --set out=OUT.",
)
@click.option("--steps", type=int, default=None, help="Same as --set steps=STEPS.")
@click.option(
    "--resume",
    "resume_latest",
    is_flag=True,
    help="Continue the run in `out` from its latest checkpoint (--set resume=OUT/checkpoints/step-N).",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace the run in `out` (metrics.jsonl, checkpoints/, tensorboard/, databases) instead of "
    "refusing to start.",
)
@logging_options("warning")
def train(
    config: Path,
    sets: tuple[str, ...],
    out: Path | None,
    steps: int | None,
    resume_latest: bool,
    overwrite: bool,
    log_level: str,
    log_json: bool,
) -> None:
    """Train the policy in CONFIG (YAML) with GRPO over rollouts of its tasks.

    \b
    Every field, its default and meaning: docs/reference/train-config.md.
    Writes under the config's `out` directory:
      metrics.jsonl               one JSON line per step (docs/reference/metrics.md)
      eval.jsonl                  one JSON line per held-out evaluation (with `eval:`; docs/training.md)
      checkpoints/step-N/         Hugging Face model + tokenizer, optimizer.pt, trainer_state.json
      gateway.db, server.db       every recorded model call; the rollout server's state

    An `out` that already holds a run (metrics.jsonl, eval.jsonl or checkpoints) is never overwritten silently: start
    with --resume (continue from its latest checkpoint, metrics appended), `resume:` in the config, or
    --overwrite; otherwise polar train refuses. Ctrl-C stops after cancelling the rollouts in flight,
    keeps every finished step's metrics and checkpoints, and exits with status 130.

    \b
    Examples (CPU, the offline tiny model, a shell harness):
      polar train examples/train.yaml
      polar train examples/train.yaml --set loss.eps_high=0.3 --set optimizer.lr=2e-6
      polar train examples/train.yaml --set metrics.tensorboard=true --steps 20
    """
    from polar.extras import TENSORBOARD, TRAINER, WANDB, require_cli

    require_cli(TRAINER)  # polar.train imports torch
    from polar.train.config import (
        ConfigError,
        Override,
        OverrideError,
        load_config,
        parse_override,
        upload_roots,
    )
    from polar.train.loop import train as run_training

    try:
        overrides = [parse_override(text) for text in sets]
        if out is not None:
            overrides.append(Override(f"--out {out}", ("out",), str(out)))
        if steps is not None:
            overrides.append(Override(f"--steps {steps}", ("steps",), steps))
        cfg, tasks = load_config(config, overrides)
    except OverrideError as exc:
        raise BadOverride(str(exc)) from None
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    require_cli(*([TENSORBOARD] if cfg.metrics.tensorboard else []), *([WANDB] if cfg.metrics.wandb else []))
    if cfg.resume is not None and not (Path(cfg.resume) / "trainer_state.json").is_file():
        raise click.ClickException(
            f"resume: {cfg.resume} is not a checkpoint written by polar train (no trainer_state.json)"
        )
    from polar.modelsource import ModelNotFound, prepare_model

    try:  # before minutes of loading: a model that is not here and cannot be downloaded now
        prepare_model(cfg.resume or cfg.model)
    except ModelNotFound as exc:
        raise click.ClickException(f"{config}: model: {exc}") from None
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.ClickException(f"{config}: device: CUDA is not available here (use cpu or auto)")
    setup_logging(log_level, json=log_json)
    interrupt.guard()
    console = _console()
    run_dir = Path(cfg.out)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0:
        # A torchrun rank but the first: rank 0 owns the out folder, the rollouts and the sync; this one
        # steps on its share of each batch (polar.train.distributed), from the checkpoint rank 0 resumes.
        saved = checkpoints(run_dir) if resume_latest else []
        if saved:
            cfg = cfg.model_copy(update={"resume": str(saved[-1])})
        run_training(cfg, tasks, None, upload_roots(cfg, config))
        _end_rank()
        return
    try:
        with locked(run_dir):
            cfg, start = _start(cfg, run_dir, resume_latest=resume_latest, overwrite=overwrite)
            click.echo(start)
            console.print(
                f"training {cfg.model or 'the offline tiny model'} for {cfg.steps} steps on {len(tasks)} "
                f"task(s); backend {cfg.backend}; out {cfg.out}"
            )
            history = run_training(cfg, tasks, console, upload_roots(cfg, config))
    except RunDirError as exc:
        raise click.ClickException(str(exc)) from None
    except RuntimeError as exc:  # a sink that is not installed, a failed weight sync, a dead server
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        _interrupted(run_dir, cfg.steps)
    last = history[-1] if history else None
    if last is not None:
        console.print(
            f"done: {last.step} steps, policy version {last.policy_version}, "
            f"last reward {last.reward_mean:.3f}; metrics {Path(cfg.out) / 'metrics.jsonl'}, "
            f"checkpoints {Path(cfg.out) / 'checkpoints'}"
        )
    _end_rank()


def _end_rank() -> None:
    """Under torchrun, a rank that trained to the end exits here, without the interpreter's finalization
    (`polar.train.distributed.end_process` says which race that avoids); a single process returns."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from polar.train import distributed

        distributed.end_process(0)


def _start(cfg: TrainConfig, out: Path, *, resume_latest: bool, overwrite: bool) -> tuple[TrainConfig, str]:
    """How the run starts in `out` (the config, maybe with `resume` set, and the line saying so): a run
    already there is resumed or replaced only when asked, never trained over silently."""
    saved, steps = checkpoints(out), metrics_steps(out)
    if overwrite:
        if resume_latest:
            raise RunDirError("--resume continues the run in out, --overwrite replaces it: give one")
        if cfg.resume is not None and Path(cfg.resume).resolve().is_relative_to(out.resolve()):
            raise RunDirError(f"--overwrite would delete the checkpoint resume: names ({cfg.resume})")
        removed = remove(out, TRAIN_FILES)
        if removed:
            return cfg, f"overwrote {out} (removed {', '.join(removed)}): new run"
        return cfg, f"new run in {out}"
    if resume_latest:
        if not saved:
            raise RunDirError(
                f"--resume: {out} has no checkpoint to continue from (checkpoints/step-N); "
                "checkpoint_every saves them along the way"
            )
        cfg = cfg.model_copy(update={"resume": str(saved[-1])})
    if cfg.resume is not None:
        if not (Path(cfg.resume) / "trainer_state.json").is_file():
            raise RunDirError(
                f"resume: {cfg.resume} is not a checkpoint written by polar train (no trainer_state.json)"
            )
        line = f"resuming from {cfg.resume}: metrics appended to {out / 'metrics.jsonl'}"
        name = Path(cfg.resume).name
        step = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None
        later = sorted({s for s in steps if step is not None and s > step})
        if later:  # steps the interrupted run took past its last checkpoint: kept, and taken again
            span = f"step {later[0]}" if len(later) == 1 else f"steps {later[0]}-{later[-1]}"
            line += (
                f"; the interrupted run's lines for {span} (past the checkpoint) stay, resumed steps follow"
            )
        return cfg, line
    evaluated = out / "eval.jsonl"
    if saved or steps or (evaluated.is_file() and evaluated.stat().st_size):
        held = f"{len(steps)} steps in metrics.jsonl"
        if saved:
            held += f", last checkpoint {saved[-1].relative_to(out)}"
        elif not steps:  # killed during the baseline evaluation: its lines would mix with a new run's
            held = "evaluations in eval.jsonl"
        raise RunDirError(
            f"{out} already holds a training run ({held}): continue it with --resume, replace it with "
            "--overwrite, or choose another --out"
        )
    return cfg, f"new run in {out}"


def _interrupted(out: Path, total: int) -> NoReturn:
    """Ctrl-C or SIGTERM: what the run kept and how to go on, then exit status 130 or 143 (no traceback, no
    "Aborted!")."""
    steps, saved = metrics_steps(out), checkpoints(out)
    click.echo(f"interrupted: rollouts in flight were cancelled; {len(steps)} step(s) of {total} recorded")
    click.echo(f"metrics: {out / 'metrics.jsonl'}")
    if saved:
        click.echo(f"last checkpoint: {saved[-1]}; continue with the same command and --resume")
    else:
        click.echo("no checkpoint yet (checkpoint_every saves them along the way)")
    raise click.exceptions.Exit(interrupt.exit_status())
