"""docs/reference is what the code generates, and what it declares matches what the code writes.

Each declaration the reference is rendered from (field descriptions, `METRICS`, `polar.docs.keys`,
`polar.train.names`) is checked against the real thing: the models' fields, the keys a build, the reward
rules and a node session write, the export schemas, a real training step's metrics line, TRL's GRPOConfig.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from pydantic import BaseModel

from polar.docs import REFERENCE, render_all, stale
from polar.docs import keys as K
from polar.docs.__main__ import main
from polar.docs.example import RECORDS, TASK, example, metrics_example
from polar.docs.tables import sections
from polar.rollout.node.side_calls import apply_policy
from polar.rollout.protocol import SessionResult, SessionStatus
from polar.rollout.rewards import assign_rewards
from polar.task import Task
from polar.train.config import TrainConfig, field_paths
from polar.train.export import conversation_schema
from polar.train.metrics import METRICS, StepMetrics, undeclared
from polar.train.names import NAMES
from polar.trajectory import build
from polar.trajectory.export import COLUMNS
from polar.trajectory.models import Trace, Trajectory
from polar.trajectory.stats import BuildStats
from tests.test_trajectory_rules import A1, A2, EOT, P1, P2, U1, rec

ROOT = Path(__file__).resolve().parents[1]


def names(keys: tuple[K.Key, ...], *, always: bool = False) -> set[str]:
    return {k.name for k in keys if k.always or not always}


# -- the pages --------------------------------------------------------------------------------------------


def test_reference_pages_are_what_the_code_generates() -> None:
    assert stale(REFERENCE) == [], "regenerate with: .venv/bin/python -m polar.docs"


def test_the_generator_writes_and_checks_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = ["--out", str(tmp_path)]
    assert main([*run, "--check"]) == 1  # empty folder
    assert main(run) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(render_all())
    assert main([*run, "--check"]) == 0
    (tmp_path / "metrics.md").write_text("edited by hand\n")
    (tmp_path / "old.md").write_text("a page no longer generated\n")
    capsys.readouterr()
    assert main([*run, "--check"]) == 1
    err = capsys.readouterr().err
    assert "metrics.md" in err and "old.md" in err and "python -m polar.docs" in err
    assert main(run) == 0 and not (tmp_path / "old.md").exists() and stale(tmp_path) == []


@pytest.mark.parametrize("root", [TrainConfig, Task, SessionResult, Trajectory, Trace])
def test_every_documented_field_has_a_description(root: type[BaseModel]) -> None:
    missing = [
        f"{s.prefix}{name}"
        for s in sections(root, root.__name__)
        for name, info in s.model.model_fields.items()
        if not info.description
    ]
    assert missing == []


# -- metrics.jsonl ----------------------------------------------------------------------------------------


def test_every_step_metrics_field_is_declared_and_the_writer_uses_the_declared_order() -> None:
    fields = [f.name for f in dataclasses.fields(StepMetrics) if f.name != "extra"]
    assert undeclared(fields) == []
    line = metrics_example().to_dict()
    assert list(line) == list(METRICS)  # every declared key has an example value, in the writer's order
    extra = dataclasses.replace(metrics_example(), extra={"masked": 1.0, "brand_new": 2.0}).to_dict()
    assert list(extra)[-1] == "brand_new" and undeclared(extra) == ["brand_new"]


@pytest.mark.slow  # loads the tiny model and runs the whole stack
def test_a_real_training_step_writes_only_documented_metrics_and_takes_the_overrides(tmp_path: Path) -> None:
    out = tmp_path / "run"
    tasks = yaml.safe_load((ROOT / "examples" / "train.yaml").read_text())["tasks"]
    (tmp_path / "held-out.yaml").write_text(yaml.safe_dump(tasks))
    proc = subprocess.run(
        [sys.executable, "-m", "polar", "train", str(ROOT / "examples" / "train.yaml"),
         "--set", "group_size=2", "--set", "batch_groups=1", "--set", "max_in_flight=1",
         "--set", "optimizer.lr=2e-6", "--steps", "1", "--out", str(out),
         # held out: the config's own task (a copy), so the eval_* keys land in the line too
         "--set", "eval.tasks=held-out.yaml", "--set", "eval.samples=1", "--set", "eval.before_training=false"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [orjson.loads(raw) for raw in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert undeclared(line) == [], "declare the new keys in polar.train.metrics.METRICS"
    assert list(line) == list(METRICS)
    assert line["groups"] == 1 and line["samples"] + line["masked"] == 2  # the overrides took effect


# -- results.jsonl: the declared keys are the keys the code writes ------------------------------------------


def test_statuses_and_timings_are_the_nodes() -> None:
    assert [k.name for k in K.SESSION_STATUSES] == [s.value for s in SessionStatus if s.terminal]
    timings = example().result.timings  # the example session reached every stage
    assert list(timings) == [k.name for k in K.TIMINGS]


def test_result_metadata_keys_are_declared() -> None:
    metadata = example().result.metadata
    assert names(K.RESULT_METADATA) <= set(metadata) <= names(K.RESULT_METADATA) | set(TASK.metadata)


def test_trajectory_metadata_keys_are_declared() -> None:
    assert names(K.TRAJECTORY_BUILD) == {"session_id"} | {f.name for f in dataclasses.fields(BuildStats)}
    trajectory = example().result.trajectory
    assert trajectory is not None
    declared = names(K.TRAJECTORY_BUILD) | names(K.TRAJECTORY_NODE) | names(K.TRAJECTORY_REWARDS)
    assert set(trajectory["metadata"]) - set(TASK.metadata) <= declared
    assert names(K.TRAJECTORY_NODE) | names(K.TRAJECTORY_REWARDS, always=True) <= set(trajectory["metadata"])
    masked = assign_rewards(build(RECORDS), "ERROR", None, reason="runtime failed")
    assert set(masked.metadata) <= declared and "reward_reason" in masked.metadata


def test_side_call_keys_are_declared() -> None:
    for policy in ("train", "exclude", "route"):
        _, summary = apply_policy(RECORDS, policy)
        assert names(K.SIDE_CALLS, always=True) <= set(summary) <= names(K.SIDE_CALLS)
    assert "routed_completion_ids" in apply_policy(RECORDS, "route")[1]


def _trace_metadata() -> list[dict[str, Any]]:
    """Trace metadata of builds that hit every kind of chain start: root, merge, retry, drift, flags."""
    a1b = [23, EOT]
    drifted = [*P1, 21, EOT, *U1]
    builds = [
        build([rec(0, P1, A1), rec(1, P2, A2)]),
        build([rec(0, P1, A1), rec(1, P1, a1b), rec(2, P1 + a1b + U1, A2)]),  # a retry
        build([rec(0, P1, A1), rec(1, drifted, A2)]),  # a drift split
        build([rec(0, P1, A1, flags=("tool_call_parse_error",)), rec(1, P2, A2)], "per_request"),
    ]
    builds.append(assign_rewards(builds[0], "ERROR", None, reason="runtime failed"))
    return [t.metadata for b in builds for t in b.traces]


def test_trace_metadata_keys_are_declared() -> None:
    seen: set[str] = set()
    for meta in _trace_metadata():
        assert names(K.TRACE_METADATA, always=True) <= set(meta) <= names(K.TRACE_METADATA)
        seen |= set(meta)
    assert {"sibling_of", "retry_of", "split_from", "diverged_from", "flags", "masked"} <= seen


def test_export_columns_are_declared() -> None:
    assert [k.name for k in K.TRACE_COLUMNS] == list(COLUMNS)
    assert [k.name for k in K.CONVERSATION_COLUMNS] == conversation_schema().names


# -- the name table ----------------------------------------------------------------------------------------


def test_every_train_config_field_has_one_row_in_the_name_table() -> None:
    paths = field_paths()
    leaves = [p for p in paths if not any(q.startswith(p + ".") for q in paths)]  # sections have no row
    assert [r.polar for r in NAMES] == leaves


def test_trl_names_are_fields_of_grpo_config() -> None:
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    unknown = [(r.polar, n) for r in NAMES for n in r.trl.names if n not in fields]
    assert unknown == []
    assert ("group_size", "num_generations") in [(r.polar, n) for r in NAMES for n in r.trl.names]
