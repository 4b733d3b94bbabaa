"""`polar train CONFIG`: GRPO on this machine, rollouts through the rollout service, any harness.

It starts the policy server (the embedded engine, or uses the vLLM server the config names), the rollout
server and a gateway node, then trains: task groups run while the policy trains, each step's weights are
synced to the policy server between a gateway pause and resume. See `polar.train.config` for the file
and `--set` overrides (docs/reference/train-config.md lists every field).
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console


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
def train(config: Path, sets: tuple[str, ...], out: Path | None, steps: int | None) -> None:
    """Train the policy in CONFIG (YAML) with GRPO over rollouts of its tasks.

    \b
    Every field, its default and meaning: docs/reference/train-config.md.
    Writes under the config's `out` directory:
      metrics.jsonl               one JSON line per step (docs/reference/metrics.md)
      checkpoints/step-N/         Hugging Face model + tokenizer, optimizer.pt, trainer_state.json
      gateway.db, server.db       every recorded model call; the rollout server's state

    \b
    Examples (CPU, the offline tiny model, a shell harness):
      polar train examples/train.yaml
      polar train examples/train.yaml --set loss.eps_high=0.3 --set optimizer.lr=2e-6
      polar train examples/train.yaml --set metrics.tensorboard=true --steps 20
    """
    from polar.extras import TENSORBOARD, TRAINER, WANDB, require_cli

    require_cli(TRAINER)  # polar.train imports torch
    from polar.train.config import ConfigError, Override, OverrideError, load_config, parse_override
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
    console = Console()
    console.print(
        f"training {cfg.model or 'the offline tiny model'} for {cfg.steps} steps on {len(tasks)} task(s); "
        f"backend {cfg.backend}; out {cfg.out}"
    )
    try:
        history = run_training(cfg, tasks, console)
    except RuntimeError as exc:  # a sink that is not installed, a failed weight sync, a dead server
        raise click.ClickException(str(exc)) from None
    last = history[-1] if history else None
    if last is not None:
        console.print(
            f"done: {last.step} steps, policy version {last.policy_version}, "
            f"last reward {last.reward_mean:.3f}; metrics {Path(cfg.out) / 'metrics.jsonl'}, "
            f"checkpoints {Path(cfg.out) / 'checkpoints'}"
        )
