"""Pass fractions from real pytest and unittest output (polar.evaluate.parsing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from polar.evaluate.parsing import RunCounts, parse_pytest, parse_unittest

MIXED = """
import unittest

class T(unittest.TestCase):
    def test_fail(self):
        self.assertEqual(1, 2)
    def test_pass(self):
        pass
    def test_pass2(self):
        pass
    def test_error(self):
        raise RuntimeError("boom")
    @unittest.skip("not here")
    def test_skip(self):
        pass
    @unittest.expectedFailure
    def test_xfail(self):
        self.assertEqual(1, 2)
"""


def _run(tmp_path: Path, runner: list[str], files: dict[str, str]) -> str:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", *runner], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    return proc.stdout + "\n" + proc.stderr


@pytest.mark.parametrize("quiet", [True, False])
def test_pytest_real_output(tmp_path: Path, quiet: bool) -> None:
    args = ["pytest", "-p", "no:cacheprovider", *(["-q"] if quiet else [])]
    out = _run(tmp_path, args, {"test_mixed.py": MIXED})
    assert parse_pytest(out) == RunCounts(passed=2, failed=2, ignored=2)
    assert parse_pytest(out).fraction == 0.5  # type: ignore[union-attr]


def test_pytest_collection_error(tmp_path: Path) -> None:
    out = _run(tmp_path, ["pytest", "-q", "-p", "no:cacheprovider"], {"test_bad.py": "import no_such_mod\n"})
    counts = parse_pytest(out)
    assert counts == RunCounts(passed=0, failed=1, ignored=0) and counts.fraction == 0.0


def test_pytest_no_tests(tmp_path: Path) -> None:
    out = _run(tmp_path, ["pytest", "-q", "-p", "no:cacheprovider"], {"test_empty.py": "x = 1\n"})
    counts = parse_pytest(out)
    assert counts == RunCounts(0, 0, 0) and counts.fraction == 0.0


def test_unittest_real_output(tmp_path: Path) -> None:
    out = _run(tmp_path, ["unittest"], {"test_mixed.py": MIXED})
    assert parse_unittest(out) == RunCounts(passed=2, failed=2, ignored=2)


def test_unittest_all_pass(tmp_path: Path) -> None:
    text = "import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n        pass\n"
    out = _run(tmp_path, ["unittest"], {"test_ok.py": text})
    assert parse_unittest(out) == RunCounts(passed=1, failed=0, ignored=0)


def test_unittest_import_error(tmp_path: Path) -> None:
    out = _run(tmp_path, ["unittest"], {"test_bad.py": "import no_such_mod\n"})
    counts = parse_unittest(out)
    assert counts is not None and counts.passed == 0 and counts.failed == 1


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("3 passed in 0.01s", RunCounts(3, 0, 0)),
        ("==== 1 failed, 3 passed, 2 warnings in 1.20s ====", RunCounts(3, 1, 0)),
        ("= 2 errors, 1 xpassed in 0.3s (0:00:00) =", RunCounts(0, 2, 1)),
        ("\x1b[32m\x1b[1m5 passed\x1b[0m\x1b[32m in 0.02s\x1b[0m", RunCounts(5, 0, 0)),  # --color=yes
        ("1 passed, 1 deselected in 0.1s", RunCounts(1, 0, 0)),
        ("no tests ran in 0.01s", RunCounts(0, 0, 0)),
        # The last summary wins: a test printing a fake one earlier cannot lift its score.
        ("99 passed in 0.1s\n...\n1 failed in 0.2s", RunCounts(0, 1, 0)),
        ("all good", None),
        ("", None),
        ("collected 3 items in 2s", None),
    ],
)
def test_pytest_lines(text: str, want: RunCounts | None) -> None:
    assert parse_pytest(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Ran 3 tests in 0.001s\n\nOK", RunCounts(3, 0, 0)),
        ("Ran 1 test in 0.001s\n\nOK (skipped=1)", RunCounts(0, 0, 1)),
        ("Ran 4 tests in 0.1s\n\nFAILED (failures=1, unexpected successes=1)", RunCounts(2, 2, 0)),
        ("Ran 0 tests in 0.000s\n\nNO TESTS RAN", RunCounts(0, 0, 0)),
        ("Ran 3 tests in 0.001s\n\nOK\nRan 2 tests in 0.1s\n\nFAILED (errors=2)", RunCounts(0, 2, 0)),
        ("Ran 3 tests in 0.001s\n\nsomething else", None),
        ("OK", None),
    ],
)
def test_unittest_lines(text: str, want: RunCounts | None) -> None:
    assert parse_unittest(text) == want


def test_fraction() -> None:
    assert RunCounts(3, 1, 5).fraction == 0.75
    assert RunCounts(0, 0, 2).fraction == 0.0
