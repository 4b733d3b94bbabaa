"""Rows in each published shape (SWE-bench, SWE-Gym, SWE-smith, R2E-Gym) for the textstats instances of
examples/swe, whose image is built here (tests/test_swebench.py's): what the loaders and graders of
`polar.rollout.published` are tested on, offline."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SWE = ROOT / "examples" / "swe"
INSTANCES = {d["instance_id"]: d for d in map(json.loads, (SWE / "instances.jsonl").read_text().splitlines())}
BASE = INSTANCES["polar-swe__textstats-1"]["base_commit"]
PYTEST_RA = "python3 -m pytest -rA -p no:cacheprovider"
# A spec for the textstats repository in swebench's MAP_REPO_VERSION_TO_SPECS shape.
SWEBENCH_SPECS = {"polar/textstats": {"1.0": {"test_cmd": PYTEST_RA, "log_parser": "parse_log_pytest"}}}


def swebench_row(iid: str) -> dict[str, Any]:
    """A row as the SWE-bench datasets publish it: FAIL_TO_PASS/PASS_TO_PASS as JSON text, no eval script."""
    inst = INSTANCES[iid]
    row = {k: inst[k] for k in ("instance_id", "repo", "base_commit", "patch", "test_patch", "version")}
    row |= {"problem_statement": inst["problem_statement"], "hints_text": "", "created_at": "2026-01-01"}
    row |= {
        "FAIL_TO_PASS": json.dumps(inst["FAIL_TO_PASS"]),
        "PASS_TO_PASS": json.dumps(inst["PASS_TO_PASS"]),
    }
    return row | {"environment_setup_commit": inst["base_commit"]}


# SWE-smith: the image holds the repository clean; the row's patch *creates* the bug (here in
# mean_word_length, which the base commit has right), and the fix is its reverse.
SWESMITH_REPO = f"swesmith/polar-swe__textstats.{BASE[:8]}"
SWESMITH_ID = f"polar-swe__textstats.{BASE[:8]}.func_pm_op_change__polar1"
SWESMITH_TEST_CMD = "python3 -m pytest --disable-warnings --color=no --tb=no --verbose -p no:cacheprovider"
SWESMITH_SPECS = {SWESMITH_REPO: {"test_cmd": SWESMITH_TEST_CMD}}


def swesmith_row(textstats_source: str) -> dict[str, Any]:
    """A SWE-smith row for a bug made in textstats/__init__.py (whose text is given)."""
    buggy = textstats_source.replace("/ len(ws)", "/ (len(ws) + 1)")
    name = "textstats/__init__.py"
    hunks = difflib.unified_diff(
        textstats_source.splitlines(True), buggy.splitlines(True), f"a/{name}", f"b/{name}"
    )
    patch = f"diff --git a/{name} b/{name}\n" + "".join(hunks)
    return {
        "instance_id": SWESMITH_ID,
        "repo": SWESMITH_REPO,
        "patch": patch,
        "FAIL_TO_PASS": ["tests/test_textstats.py::test_mean_word_length"],
        "PASS_TO_PASS": ["tests/test_textstats.py::test_word_count_simple"],
        "created_at": "2026-01-01T00:00:00",
        "image_name": "polar-swe-textstats:1",
        "base_commit": BASE,
        "problem_statement": "mean_word_length is too small",
    }


# R2E-Gym: hidden tests in /r2e_tests and /testbed/run_tests.sh in the image (R2E_DOCKERFILE adds them).
R2E_TESTS = """from textstats import mean_word_length, word_count


def test_word_count_simple():
    assert word_count("the quick brown fox") == 4


def test_word_count_extra_spaces():
    assert word_count("  the quick   brown fox ") == 4


def test_mean_word_length():
    assert mean_word_length("ab abcd") == 3.0
"""
R2E_RUN_TESTS = "python3 -W ignore -m pytest -rA -p no:cacheprovider r2e_tests\n"
R2E_DOCKERFILE = "FROM polar-swe-textstats:1\nCOPY test_1.py /r2e_tests/test_1.py\nCOPY run_tests.sh /testbed/run_tests.sh\n"
R2E_IMAGE = "polar-swe-textstats-r2e:1"


def r2e_row() -> dict[str, Any]:
    expected = {"test_word_count_simple": "PASSED", "test_word_count_extra_spaces": "PASSED"}
    expected["test_mean_word_length"] = "PASSED"
    commit = {"old_commit_hash": BASE, "new_commit_hash": "f" * 40, "file_diffs": [], "commit_message": "fix"}
    statement = INSTANCES["polar-swe__textstats-1"]["problem_statement"]
    return {
        "repo_name": "textstats",
        "docker_image": R2E_IMAGE,
        "commit_hash": "f" * 40,
        "problem_statement": f"[ISSUE]\n{statement}\n[/ISSUE]",
        "expected_output_json": json.dumps(expected),
        "parsed_commit_content": json.dumps(commit),
        "execution_result_content": "",
        "modified_files": ["textstats/__init__.py"],
    }


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
