"""`polar train CONFIG`: GRPO on this machine, rollouts through the rollout service, any harness.

It starts the policy server (the embedded engine, or uses the vLLM server the config names), the rollout
server and a gateway node, then trains: task groups run while the policy trains, each step's weights are
synced to the policy server between a gateway pause and resume. See `polar.train.config` for the file.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console


@click.command("train")
@click.argument("config", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Overrides the config's `out`.",
)
@click.option("--steps", type=int, default=None, help="Overrides the config's `steps`.")
def train(config: Path, out: Path | None, steps: int | None) -> None:
    """Train the policy in CONFIG (YAML) with GRPO over rollouts of its tasks.

    \b
    Writes under the config's `out` directory:
      metrics.jsonl               one JSON line per step (step, policy_version, reward_mean, pass_rate,
                                  tokens, staleness, clip_fraction, kl, loss, time per stage, ...)
      checkpoints/step-N/         Hugging Face model + tokenizer, optimizer.pt, trainer_state.json
      gateway.db, server.db       every recorded model call; the rollout server's state

    \b
    Example (CPU, the offline tiny model, a shell harness):
      polar train examples/train.yaml
    """
    from polar.train.config import ConfigError, load_config, upload_roots
    from polar.train.loop import train as run_training

    try:
        cfg, tasks = load_config(config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    updates: dict[str, object] = {}
    if out is not None:
        updates["out"] = str(out)
    if steps is not None:
        if steps < 1:
            raise click.BadParameter("must be at least 1", param_hint="--steps")
        updates["steps"] = steps
    cfg = cfg.model_copy(update=updates)
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
        history = run_training(cfg, tasks, console, upload_roots(cfg, config))
    except RuntimeError as exc:  # a sink that is not installed, a failed weight sync, a dead server
        raise click.ClickException(str(exc)) from None
    last = history[-1] if history else None
    if last is not None:
        console.print(
            f"done: {last.step} steps, policy version {last.policy_version}, "
            f"last reward {last.reward_mean:.3f}; metrics {Path(cfg.out) / 'metrics.jsonl'}, "
            f"checkpoints {Path(cfg.out) / 'checkpoints'}"
        )
