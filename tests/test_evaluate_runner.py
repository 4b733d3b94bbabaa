# ruff: noqa: F811  (`make_repo` is a fixture imported from tests.evaluate_support)
"""The trusted runner (`command` with `runner: unittest | pytest`) in real runtimes with real interpreters:
the verdict comes from a report the tested code cannot print or pre-write, checked against the tests the
task had before the diff, with a canary and a check of the framework's functions."""

from __future__ import annotations

import string
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.evaluate import CommandEvaluator, EvaluatorError, get_evaluator
from polar.evaluate.runner import Report, judge, parse_report
from polar.runtime.base import Runtime
from tests.evaluate_support import (  # noqa: F401  (make_repo is a fixture)
    CALC,
    FIX_ADD,
    FIX_MUL,
    MakeRepo,
    context,
    edit,
    make_repo,
    must,
)

PY = sys.executable  # has pytest; the runtime's `python3` may not
IDS = [f"tests.test_calc.CalcTest.test_{n}" for n in ("add", "mul", "neg")]


def runner(kind: str = "unittest", **config: object) -> CommandEvaluator:
    config = {"runner": kind, "python": PY, "protect": ["tests"], "score": "fraction", **config}
    ev = get_evaluator("command", config)
    assert isinstance(ev, CommandEvaluator)
    return ev


async def fixed(make_repo: MakeRepo, *fixes: tuple[str, str]) -> tuple[Runtime, Runtime]:
    agent, fresh = await make_repo(), await make_repo()
    for old, new in fixes:
        await edit(agent, "calc.py", old, new)
    return agent, fresh


@pytest.mark.parametrize("kind", ["unittest", "pytest"])
async def test_a_fix_earns_1_and_half_a_fix_its_fraction(make_repo, kind: str) -> None:
    agent, fresh = await fixed(make_repo, FIX_ADD, FIX_MUL)
    res = await runner(kind).evaluate(context(agent, fresh))
    assert (res.reward, res.passed) == (1.0, True), res.details
    assert res.details["reason"] == "3/3 tests passed"
    agent, fresh = await fixed(make_repo, FIX_ADD)
    res = await runner(kind).evaluate(context(agent, fresh))
    assert res.reward == pytest.approx(2 / 3) and res.passed is False, res.details
    assert res.details["failed"] == [
        (
            "tests.test_calc.CalcTest.test_mul"
            if kind == "unittest"
            else "tests/test_calc.py::CalcTest::test_mul"
        )
        + " (failed)"
    ]


@pytest.mark.parametrize(
    ("kind", "hack", "reason"),
    [
        # the process ends at import with status 0: no report
        ("unittest", "import os\nos._exit(0)\n", "left no report"),
        ("pytest", "import os\nos._exit(0)\n", "left no report"),
        # SystemExit at import: the test module fails to load, its tests never run
        ("unittest", "raise SystemExit(0)\n", "expected tests did not run"),
        # assertions that cannot fail
        ("unittest", "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n", "tampered"),
        # every report a pass
        (
            "pytest",
            "import _pytest.reports as r\n"
            "_orig = r.TestReport.from_item_and_call\n"
            "def _pass(item, call):\n"
            "    rep = _orig(item, call)\n"
            "    rep.outcome, rep.longrepr = 'passed', None\n"
            "    return rep\n"
            "r.TestReport.from_item_and_call = staticmethod(_pass)\n",
            "tampered",
        ),
        # a report printed, in the runner's format, with a nonce of its own
        (
            "unittest",
            "import sys\nfor out in (sys.stdout, sys.stderr):\n"
            "    out.write('n0nce BEGIN\\n' + ''.join(f'n0nce RESULT {t!r}, \"passed\"\\n' for t in "
            f"{IDS!r}) + 'n0nce CANARY \"failed\"\\nn0nce END\\n')\n",
            "2/3 tests passed",
        ),
        # failures become skips
        (
            "unittest",
            "import unittest\ndef mul(a, b):\n    raise unittest.SkipTest('later')\n",
            "2/3 tests passed",
        ),
    ],
    ids=[
        "exit0-unittest",
        "exit0-pytest",
        "systemexit",
        "assert-patched",
        "report-patched",
        "printed-report",
        "skip",
    ],
)
async def test_the_tested_code_cannot_talk_the_runner_into_a_pass(
    make_repo, kind: str, hack: str, reason: str
) -> None:
    agent, fresh = await fixed(make_repo, FIX_ADD)  # one bug left
    path = agent.workdir / "calc.py"
    path.write_text(path.read_text() + "\n" + hack)
    res = await runner(kind).evaluate(context(agent, fresh))
    assert res.reward is not None and res.reward < 1.0 and res.passed is False, res.details
    assert reason in res.details["reason"], res.details


@pytest.mark.parametrize(
    ("kind", "tests"),
    [
        ("unittest", ["tests"]),  # a start directory
        ("unittest", ["tests/test_calc.py"]),  # a file, as `python -m unittest` takes it
        ("unittest", ["tests.test_calc.CalcTest"]),  # a dotted name
        ("pytest", ["tests/test_calc.py::CalcTest"]),  # pytest's own arguments
    ],
)
async def test_what_to_run(make_repo: MakeRepo, kind: str, tests: list[str]) -> None:
    agent, fresh = await fixed(make_repo, FIX_ADD, FIX_MUL)
    res = await runner(kind, tests=tests).evaluate(context(agent, fresh))
    assert res.reward == 1.0 and res.details["reason"] == "3/3 tests passed", res.details


async def test_skips_at_run_time_are_left_out_when_allowed(make_repo) -> None:
    agent, fresh = await fixed(make_repo, FIX_ADD)
    path = agent.workdir / "calc.py"
    path.write_text(
        path.read_text() + "\nimport unittest\ndef mul(a, b):\n    raise unittest.SkipTest('no')\n"
    )
    res = await runner(allow_skips=True).evaluate(context(agent, fresh))
    assert res.reward == 1.0 and res.details["tests_ignored"] == 1, res.details


async def test_a_task_skip_is_not_counted(make_repo) -> None:
    files = {**CALC, "tests/test_calc.py": CALC["tests/test_calc.py"].replace(
        "    def test_neg(self):", "    @unittest.skip('not yet')\n    def test_neg(self):")}  # fmt: skip
    agent, fresh = await make_repo(files), await make_repo(files)
    await edit(agent, "calc.py", *FIX_ADD)
    await edit(agent, "calc.py", *FIX_MUL)
    res = await runner().evaluate(context(agent, fresh))
    assert res.reward == 1.0 and res.details["tests_ignored"] == 1, res.details


async def test_a_test_file_outside_protect_is_protected_by_the_collection(make_repo) -> None:
    agent, fresh = await fixed(make_repo, FIX_ADD)
    await edit(agent, "tests/test_calc.py", "mul(2, 3), 6", "mul(2, 3), 5")
    res = await runner(protect=[]).evaluate(context(agent, fresh))
    assert res.details["refused"] == [{"path": "tests/test_calc.py", "why": "touches a protected path"}]


async def test_expected_tests_named_by_the_task(make_repo) -> None:
    agent, fresh = await fixed(make_repo, FIX_ADD)
    res = await runner(expected_tests=[IDS[0], IDS[2]]).evaluate(context(agent, fresh))
    assert res.reward == 1.0 and res.details["reason"] == "2/2 tests passed", res.details
    agent, fresh = await fixed(make_repo, FIX_ADD)
    res = await runner(expected_tests=[*IDS, "tests.test_calc.CalcTest.test_gone"]).evaluate(
        context(agent, fresh)
    )
    assert res.reward == 0.0 and res.details["missing"] == ["tests.test_calc.CalcTest.test_gone"]


async def test_tests_that_cannot_load_before_the_fix_are_the_tasks_problem(make_repo) -> None:
    files = {**CALC, "tests/test_new.py": "import unittest\nfrom newmod import f\n"}
    agent, fresh = await make_repo(files), await make_repo(files)
    await edit(agent, "calc.py", *FIX_ADD)
    with pytest.raises(EvaluatorError, match="expected_tests"):
        await runner().evaluate(context(agent, fresh))


async def test_an_interpreter_that_is_not_there_is_the_runtimes_problem(make_repo) -> None:
    agent, fresh = await fixed(make_repo, FIX_ADD)
    with pytest.raises(EvaluatorError, match=r"evaluator\.config\.python"):
        await runner(python="no-such-python").evaluate(context(agent, fresh))


async def test_an_interpreter_in_the_workdir_is_protected(make_repo) -> None:
    files = {**CALC, "venv/bin/python": f'#!/bin/sh\nexec {PY} "$@"\n'}
    agent, fresh = await make_repo(files), await make_repo(files)
    await must(agent, "chmod +x venv/bin/python")
    await must(fresh, "chmod +x venv/bin/python")
    await edit(agent, "calc.py", *FIX_ADD)
    (agent.workdir / "venv" / "bin" / "python").write_text("#!/bin/sh\necho forged\n")
    python = fresh.runtime_path(fresh.workdir / "venv" / "bin" / "python")
    res = await runner(python=python).evaluate(context(agent, fresh))
    assert res.details["refused"] == [{"path": "venv/bin/python", "why": "touches a protected path"}]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({}, "set exactly one of `runner`"),
        ({"runner": "unittest", "test_command": "make"}, "set exactly one of `runner`"),
        ({"runner": "unittest", "parse": "pytest"}, "`parse` reads a test_command"),
        ({"test_command": "make", "tests": ["x"]}, "tests only apply with `runner`"),
        ({"runner": "nose"}, "evaluator.config.runner"),
        ({"runner": "pytest", "expected_tests": []}, "evaluator.config.expected_tests"),
    ],
)
def test_config_mistakes_are_named(config: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match="evaluator 'command'") as err:
        get_evaluator("command", config)
    assert field in str(err.value)


# -- the report and the verdict, on their own --------------------------------------------------------------

NONCE = "a" * 32


def _report(lines: list[str]) -> str:
    return "\n".join([f"{NONCE} BEGIN", *(f"{NONCE} {ln}" for ln in lines), f"{NONCE} END"])


@settings(max_examples=200)
@given(
    st.text(string.printable, max_size=200),
    st.text(string.printable, max_size=200),
    st.lists(st.text(max_size=30), max_size=5),
)
def test_only_the_nonce_block_is_the_report(before: str, after: str, ids: list[str]) -> None:
    lines = [f"RESULT {t!a}, 'passed'" for t in ids] + ["CANARY 'failed'"]
    report = parse_report(f"{before}\n{_report(lines)}\n{after}", NONCE)
    assert report is not None and report.results == dict.fromkeys(ids, "passed")
    # Text without the nonce never makes a report; a second block with it makes none either.
    assert parse_report(before + "\n" + after, NONCE) is None
    assert parse_report(_report(lines) + "\n" + _report(lines), NONCE) is None


@pytest.mark.parametrize(
    "line",
    [
        "RESULT 'a', 'sure'",
        "RESULT 'a'",
        "TEST 'a', 'maybe'",
        "WHAT 'a'",
        "RESULT __import__('os')",
        "RESULT 1, 2",
    ],
)
def test_a_malformed_report_is_no_report(line: str) -> None:
    assert parse_report(_report([line]), NONCE) is None
    assert parse_report(f"{NONCE} BEGIN\nstray\n{NONCE} END", NONCE) is None


def test_judge() -> None:
    expected = {"a": "", "b": "", "s": "skip"}
    ok = Report(results={"a": "passed", "b": "passed", "s": "skipped"}, canary="failed")
    assert judge(expected, ok).reward == 1.0 and judge(expected, ok).passed
    assert judge(expected, None).details["reason"].startswith("the test runner left no report")
    tampered = Report(results=ok.results, canary="passed")
    assert judge(expected, tampered).details["reason"] == "the tested code tampered with the test runner"
    missing = Report(results={"a": "passed", "b": "passed"}, canary="failed")
    assert judge(expected, missing).details["missing"] == ["s"]
    skipped = Report(results={"a": "passed", "b": "skipped", "s": "skipped"}, canary="failed")
    assert judge(expected, skipped).reward == 0.5
    assert judge(expected, skipped, fraction=False).reward == 0.0
    assert judge(expected, skipped, allow_skips=True).reward == 1.0
    assert judge(expected, Report(results=ok.results, canary="failed", error="boom")).reward == 0.0
