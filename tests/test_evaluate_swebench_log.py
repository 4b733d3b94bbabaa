"""The SWE-bench log check (`polar.evaluate.swebench_log`) on pytest logs as the eval script writes them:
status lines the tests print, markers they repeat, and output after pytest's summary do not resolve an
instance; a genuine log does. The graded runs are in tests/test_swebench.py and tests/security."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("swebench")

from polar.evaluate.swebench_log import log_problem

F2P = ["tests/test_x.py::test_b"]
P2P = ["tests/test_x.py::test_a", "tests/test_x.py::test_c"]
HEAD = "+ git apply -v -\n+ : '>>>>> Start Test Output'\n+ python3 -m pytest -rA tests/test_x.py\n"
TAIL = "+ SWEBENCH_TEST_EXIT_CODE={code}\n+ : '>>>>> End Test Output'\n+ echo '>>>>> Test Exit Code: {code}'\n>>>>> Test Exit Code: {code}\n"


def log(body: str, code: int = 0) -> str:
    return HEAD + body + TAIL.format(code=code)


RESOLVED = """============================= test session starts ==============================
collected 3 items

tests/test_x.py ...                                                      [100%]

==================================== PASSES ====================================
____________________________________ test_a ____________________________________
----------------------------- Captured stdout call -----------------------------
FAILED tests/test_x.py::test_c
=========================== short test summary info ============================
PASSED tests/test_x.py::test_a
PASSED tests/test_x.py::test_b
PASSED tests/test_x.py::test_c
============================== 3 passed in 0.02s ===============================
"""
FAILING = (
    RESOLVED.replace("...", ".F.")
    .replace("PASSED tests/test_x.py::test_b\n", "FAILED tests/test_x.py::test_b - assert 0\n")
    .replace("3 passed", "1 failed, 2 passed")
)


def problem(text: str) -> str | None:
    spec: Any = None  # parse_log_pytest does not read it
    return log_problem(text, spec, "parse_log_pytest", F2P, P2P, "pass_and_fail")


def test_a_genuine_log_passes() -> None:
    assert problem(log(RESOLVED)) is None  # a printed FAILED line in captured output changes nothing


def test_status_lines_printed_at_exit_do_not_count() -> None:
    forged = FAILING + "PASSED tests/test_x.py::test_b\nFAILED tests/test_other.py::test_z\n"
    assert "ends the test output" in str(problem(log(forged, code=1)))


def test_status_lines_printed_before_the_summary_do_not_count() -> None:
    """The tested module prints PASSED lines, then breaks collection: only pytest's summary counts."""
    body = (
        "collected 0 items / 1 error\n\n==================================== ERRORS ====================================\n"
        "____________________ ERROR collecting tests/test_x.py _____________________\n"
        "----------------------------- Captured stdout -----------------------------\n"
        + "".join(f"PASSED {t}\n" for t in F2P + P2P)
        + "=========================== short test summary info ============================\n"
        "ERROR tests/test_x.py - RuntimeError\n"
        "=============================== 1 error in 0.05s ===============================\n"
    )
    assert "does not resolve" in str(problem(log(body, code=2)))


def test_repeated_markers_and_inconsistent_summaries() -> None:
    assert "markers appear" in str(problem(log(RESOLVED + ">>>>> End Test Output\n")))
    assert "markers appear" in str(problem(">>>>> Start Test Output\n" + log(RESOLVED)))
    short = RESOLVED.replace("PASSED tests/test_x.py::test_c\n", "")
    assert "summary says 3 passed" in str(problem(log(short)))
    assert "no pytest short test summary" in str(
        problem(log("tests/test_x.py ...\n== 3 passed in 0.1s ==\n"))
    )


def test_other_parsers_get_the_marker_check_only() -> None:
    spec: Any = None
    assert log_problem(log("anything\n"), spec, "parse_log_django", F2P, P2P, "pass_and_fail") is None
    twice = log("anything\n>>>>> Start Test Output\n")
    assert "markers appear" in str(log_problem(twice, spec, "parse_log_django", F2P, P2P, "pass_and_fail"))
