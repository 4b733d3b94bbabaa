"""`polar traces` against a real SQLite store: show, export (JSONL, Parquet) and audit, with failure paths."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.json as pj
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from polar.cli import main
from polar.store.records import CompletionRecord, SessionInfo
from polar.store.sqlite import SQLiteStore
from polar.trajectory import build
from tests.extras_support import one_line_error, polar_without
from tests.test_trajectory_rules import A1, A2, P1, P2, rec


def _session(sid: str, task: str) -> list[CompletionRecord]:
    drifted = [
        *P2,
        23,
        2,
        9,
        1,
        7,
    ]  # c2 re-renders c1's turn differently: split, or merged with --on-drift merge
    return [rec(0, P1, A1, session=sid), rec(1, P2, A2, session=sid), rec(2, drifted, [30, 2], session=sid)]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "polar.db"
    s = SQLiteStore(path)

    def fill(w: object) -> None:
        for sid, task in (("s1", "t1"), ("s2", "t1"), ("s3", "t2")):
            w.add_session(SessionInfo(sid, 0.0, "closed", {"task_id": task}))  # type: ignore[attr-defined]
            for r in _session(sid, task):
                w.add_completion(r)  # type: ignore[attr-defined]

    s.write(fill)
    s.close()
    return path


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["traces", *args], catch_exceptions=False)
    return result.exit_code, result.output


def test_show_prints_stats_and_traces(store: Path) -> None:
    code, out = run("show", "--store", str(store), "s1")
    assert code == 0, out
    assert "coverage" in out and "1.000000" in out and "context_drift" in out
    code, out = run("show", "--store", str(store), "--task", "t1", "--stats-only")
    assert code == 0 and out.count("prefix_merging") == 2 and "traces" in out


def test_show_json_is_the_gateway_contract(store: Path) -> None:
    code, out = run("show", "--store", str(store), "s1", "--json", "--on-drift", "merge")
    assert code == 0, out
    body = json.loads(out)
    assert body["status"] == "COMPLETED" and body["metadata"]["coverage"] == 1.0
    assert body["metadata"]["drift_merged"] == 1 and len(body["traces"]) == 1
    with SQLiteStore(store) as s:
        assert body == build(s.completions("s1"), on_drift="merge").model_dump(mode="json")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_round_trips_every_trace(store: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"traces{suffix}"
    code, text = run("export", "--store", str(store), "--task", "t1", "--out", str(out))
    assert code == 0 and "wrote 4 traces" in text, text
    # pyarrow's readers are what `datasets` uses for both formats.
    table = pj.read_json(out) if suffix == ".jsonl" else pq.read_table(out)
    got = table.to_pylist()
    assert [(r["session_id"], r["trace_index"], r["task_id"]) for r in got] == [
        ("s1", 0, "t1"),
        ("s1", 1, "t1"),
        ("s2", 0, "t1"),
        ("s2", 1, "t1"),
    ]
    with SQLiteStore(store) as s:
        t = build(s.completions("s1"))
    for row, trace in zip(got[:2], t.traces, strict=True):
        assert row["prompt_ids"] == trace.prompt_ids and row["response_ids"] == trace.response_ids
        assert row["loss_mask"] == trace.loss_mask and row["response_logprobs"] == trace.response_logprobs
        assert json.loads(row["metadata"]) == trace.metadata
        assert row["reward"] is None and row["status"] == "COMPLETED"


def test_export_needs_a_known_format(store: Path, tmp_path: Path) -> None:
    code, out = run("export", "--store", str(store), "--out", str(tmp_path / "x.bin"))
    assert code == 2 and "--format" in out
    code, _ = run("export", "--store", str(store), "--out", str(tmp_path / "x.bin"), "--format", "jsonl")
    assert code == 0


def test_audit_passes_and_fails_with_exit_codes(store: Path) -> None:
    code, out = run("audit", "--store", str(store))
    assert code == 0, out
    assert out.count("passes") == 3 and "drift (split)" in out
    # A builder that drops calls must fail its audit.
    code, out = run(
        "audit", "--store", str(store), "s3", "--strategy", "tests.test_trajectory_api:first_call_only"
    )
    assert code == 3 and "FAILS" in out and "missing from every trace" in out


def test_bad_selection_and_options_are_usage_errors(store: Path, tmp_path: Path) -> None:
    code, out = run("show", "--store", str(store), "nope")
    assert code == 2 and "no such session: nope" in out
    code, out = run("show", "--store", str(store), "s1", "--task", "t1")
    assert code == 2 and "not both" in out
    code, out = run("show", "--store", str(store), "--task", "t9")
    assert code == 2 and "no sessions for task 't9'" in out
    code, out = run("show", "--store", str(store), "s1", "--strategy", "nope")
    assert code == 2 and "unknown builder 'nope'" in out
    code, out = run("show", "--store", str(store), "s1", "--eot-id", "-1")
    assert code == 2 and "eot_id" in out
    code, out = run("show", "--store", str(tmp_path / "missing.db"), "s1")
    assert code == 2 and "does not exist" in out


@pytest.mark.parametrize("pyarrow", ["installed", "missing"])
def test_parquet_export_as_a_user_runs_it(store: Path, tmp_path: Path, pyarrow: str) -> None:
    """`polar traces export --out x.parquet` in a real process: it works where pyarrow is installed (a base
    dependency), and says in one line which extra brings it where it is not, writing nothing."""
    out = tmp_path / "x.parquet"
    blocked = ("pyarrow",) if pyarrow == "missing" else ()
    proc = polar_without(blocked, "traces", "export", "--store", str(store), "--out", str(out))
    if pyarrow == "installed":
        assert proc.returncode == 0, proc.stderr
        assert pq.read_table(out).num_rows > 0
    else:
        line = one_line_error(proc)
        assert "Parquet output needs pyarrow" in line and "pip install 'polar-rl[export]'" in line
        assert not out.exists()
