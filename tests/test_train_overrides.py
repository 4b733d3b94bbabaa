"""`polar train CONFIG --set KEY=VALUE`: dotted overrides of any config field, validated like the file, with
errors that name the override (exit status 2, one line, no traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from polar.cli import main
from polar.cli.train import train
from polar.train.config import (
    OverrideError,
    apply_overrides,
    field_paths,
    load_config,
    parse_config,
    parse_override,
    suggest,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.yaml"


def overridden(*sets: str) -> object:
    config, _ = load_config(EXAMPLE, [parse_override(s) for s in sets])
    return config


def test_overrides_change_nested_and_top_level_fields() -> None:
    config = overridden(
        "loss.eps_high=0.3",
        "optimizer.lr=2e-6",  # YAML reads 2e-6 as text; the model's float parsing takes it
        "metrics.tensorboard=true",
        "optimizer.betas=[0.9, 0.95]",
        "loss.tis_cap=null",
        "group_size=8",
    )
    assert config.loss.eps_high == 0.3 and config.optimizer.lr == 2e-6  # type: ignore[attr-defined]
    assert config.metrics.tensorboard is True and config.optimizer.betas == (0.9, 0.95)  # type: ignore[attr-defined]
    assert config.loss.tis_cap is None and config.group_size == 8  # type: ignore[attr-defined]
    # The file's other values stay; a later override wins; a mapping merges into its section.
    assert config.loss.eps_low == 0.2 and config.optimizer.weight_decay == 0.0  # type: ignore[attr-defined]
    assert overridden("steps=3", "steps=5").steps == 5  # type: ignore[attr-defined]
    merged = overridden("loss={tis_cap: 3.0, kl_coef: 0.01}").loss  # type: ignore[attr-defined]
    assert (merged.tis_cap, merged.kl_coef, merged.eps_high) == (3.0, 0.01, 0.28)


def test_a_task_file_given_by_override_is_relative_to_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "other.yaml").write_text("task_id: other\ninstruction: do it\n")
    monkeypatch.chdir(tmp_path)
    config, tasks = load_config(EXAMPLE, [parse_override("tasks=other.yaml")])
    assert config.tasks == "other.yaml" and [t.task_id for t in tasks] == ["other"]


def test_apply_overrides_leaves_the_input_alone() -> None:
    data = {"loss": {"eps_low": 0.1}, "steps": 2}
    out = apply_overrides(data, [parse_override("loss.eps_high=0.3"), parse_override("metrics.wandb=true")])
    assert out == {"loss": {"eps_low": 0.1, "eps_high": 0.3}, "steps": 2, "metrics": {"wandb": True}}
    assert data == {"loss": {"eps_low": 0.1}, "steps": 2}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "loss.eps_hi=0.3",
            "--set loss.eps_hi=0.3: no config field loss.eps_hi (did you mean loss.eps_high?)",
        ),
        ("lr=1e-5", "no config field lr (did you mean optimizer.lr?)"),
        ("learning_rate=1e-5", "(did you mean optimizer.lr?)"),  # TRL's name
        ("num_generations=8", "(did you mean group_size?)"),
        ("actor_rollout_ref.actor.clip_ratio_high=0.3", "(did you mean loss.eps_high?)"),  # verl's
        ("tasks.0.instruction=x", "tasks is a single value, not a section"),
        ("steps", "expected KEY=VALUE"),
        ("loss..eps_high=1", "has an empty name between dots"),
        ("loss.eps_high=[", "not a YAML value"),
    ],
)
def test_malformed_or_unknown_overrides_are_refused_with_a_suggestion(text: str, message: str) -> None:
    with pytest.raises(OverrideError) as err:
        parse_override(text)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["loss.eps_high=abc"], "--set loss.eps_high=abc: Input should be a valid number"),
        (["optimizer.betas=[0.9, 1.5]"], "--set optimizer.betas=[0.9, 1.5]: each beta must be in [0, 1)"),
        (
            ["loss={eps_hi: 1}"],
            "--set loss={eps_hi: 1}: loss.eps_hi: Extra inputs are not permitted (did you mean loss.eps_high?)",
        ),
        (["metrics.run_name=2024"], "Input should be a valid string (YAML reads 2024 as int; quote it"),
        (["tasks=missing.yaml"], "--set tasks=missing.yaml: "),
        (
            ["tasks=[{task_id: a, instruction: x, agnt: {}}]"],
            "tasks[0].agnt: Extra inputs are not permitted (did you mean tasks[0].agent?)",
        ),
    ],
)
def test_a_bad_value_names_the_override(sets: list[str], message: str) -> None:
    with pytest.raises(OverrideError) as err:
        load_config(EXAMPLE, [parse_override(s) for s in sets])
    assert message in str(err.value)


def test_a_bad_key_in_the_file_gets_the_line_and_a_suggestion(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("task_id: t\ninstruction: x\n")
    with pytest.raises(Exception) as err:
        parse_config("tasks: t.yaml\noptimizer:\n  learning_rate: 1\n", "cfg.yaml", tmp_path)
    assert str(err.value) == (
        "cfg.yaml:3: optimizer.learning_rate: Extra inputs are not permitted (did you mean optimizer.lr?)"
    )
    assert not isinstance(err.value, OverrideError)  # the file's fault: exit 1, not a usage error


def test_suggestions_cover_every_field() -> None:
    for path in field_paths():
        assert suggest([*path.split(".")[:-1], path.split(".")[-1] + "x"]) == path


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--set", "loss.eps_high=abc"],
            "Error: --set loss.eps_high=abc: Input should be a valid number, unable to parse string as a number",
        ),
        (["--set", "lr=1"], "Error: --set lr=1: no config field lr (did you mean optimizer.lr?)"),
        (["--steps", "0"], "Error: --steps 0: Input should be greater than or equal to 1"),
        (
            ["--set", "nonsense"],
            "Error: --set nonsense: expected KEY=VALUE with a dotted KEY, e.g. --set loss.eps_high=0.3",
        ),
    ],
)
def test_the_cli_prints_one_line_and_exits_2(args: list[str], line: str) -> None:
    result = CliRunner().invoke(train, [str(EXAMPLE), *args])
    assert result.exit_code == 2, result.output
    assert result.output == line + "\n"  # one line: no usage block, no traceback


def test_a_bad_file_exits_2_as_a_bad_override_does(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("tasks: t.yaml\noptimizer:\n  lr: 0\n")
    result = CliRunner().invoke(main, ["train", str(path), "--set", "steps=2"])
    assert (
        result.exit_code == 2
        and "train.yaml:3: optimizer.lr: Input should be greater than 0" in result.output
    )


def test_help_shows_an_override_example() -> None:
    result = CliRunner().invoke(train, ["--help"])
    assert result.exit_code == 0
    assert "--set loss.eps_high=0.3 --set optimizer.lr=2e-6" in result.output and "KEY=VALUE" in result.output


def test_a_judge_the_run_would_refuse_is_an_error_at_its_line_unless_allowed(tmp_path: Path) -> None:
    """The trainer's local server vets task-given URLs (callbacks, side calls, judge backends) at submit;
    a judge on this machine's loopback needs `allow_callback`, and without it the config says so at the
    URL's line instead of the run failing once training has started."""
    judge = {"rubric": "r", "backend": {"url": "http://127.0.0.1:9/v1", "kind": "vllm", "model": "j"}}
    task = {"task_id": "t", "instruction": "x", "evaluator": {"strategy": "judge", "config": judge}}
    text = yaml.safe_dump({"tasks": [task]}, sort_keys=False)
    with pytest.raises(Exception) as err:
        parse_config(text, "cfg.yaml", tmp_path)
    assert str(err.value).startswith(
        "cfg.yaml:9: tasks[0].evaluator.config.backend.url: 'http://127.0.0.1:9/v1' is refused: 127.0.0.1 is a "
    ), str(err.value)
    config, tasks = parse_config(text + "allow_callback: [127.0.0.1]\n", "cfg.yaml", tmp_path)
    assert config.allow_callback == ["127.0.0.1"] and [t.task_id for t in tasks] == ["t"]
    (tmp_path / "tasks.yaml").write_text(yaml.safe_dump({"tasks": [task]}, sort_keys=False))
    with pytest.raises(Exception) as err:  # the same from a task file, at the file's own line
        parse_config("tasks: tasks.yaml\n", "cfg.yaml", tmp_path)
    assert "tasks.yaml:9: tasks[0].evaluator.config.backend.url: 'http://127.0.0.1:9/v1' is refused" in str(
        err.value
    )
    with pytest.raises(Exception) as err:
        parse_config(text + "allow_callback: ['not a host!']\n", "cfg.yaml", tmp_path)
    line = len(text.splitlines()) + 1
    assert str(err.value) == (
        f"cfg.yaml:{line}: allow_callback: allowlist entry 'not a host!' is neither an IP, a CIDR nor a host name"
    )
