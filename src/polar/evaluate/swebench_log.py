"""Whether a SWE-bench evaluation log is the test run's own, before a resolved verdict counts.

The log holds the tested code's output as well as the runner's: a test (or a module it imports) can print
`PASSED <id>` lines, or the markers the grader splits on. What is checked:
- the start and end markers each appear once, in order;
- for pytest's output (the log parsers named in `PYTEST_FORMAT`, all run with `-rA`): the slice between the
  markers ends with pytest's final summary line (only the eval script's own `+ ...` trace lines may
  follow: nothing the test process printed at exit), the last "short test summary info" block agrees with
  that summary's counts, and the instance is resolved by the statuses of that block alone (parsed with the
  instance's own parser), so status lines printed elsewhere do not count.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from polar.evaluate.parsing import _PYTEST_COUNT, _PYTEST_LINE

if TYPE_CHECKING:
    from swebench.types import TestSpec

PYTEST_FORMAT = frozenset(
    {
        "parse_log_pytest",
        "parse_log_pytest_options",
        "parse_log_pytest_v2",
        "parse_log_astropy",
        "parse_log_pylint",
        "parse_log_pyvista",
        "parse_log_pydicom",
    }
)
_HEADER = re.compile(r"^=+ short test summary info =+$")
_SKIPPED = re.compile(r"^SKIPPED \[(\d+)\]")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _block(sliced: str) -> tuple[list[str], str] | str:
    """(the lines of the last short-summary block, pytest's final summary line), or what is wrong."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in sliced.splitlines()]
    end = len(lines)
    while end and (not lines[end - 1].strip() or lines[end - 1].startswith("+ ") or lines[end - 1] == "+"):
        end -= 1  # the eval script's own trace after the test command
    if not end or _PYTEST_LINE.match(lines[end - 1]) is None:
        return (
            "something other than pytest's summary line ends the test output (printed after pytest finished)"
        )
    headers = [i for i in range(end) if _HEADER.match(lines[i])]
    if not headers:
        return "the test output has no pytest short test summary"
    return lines[headers[-1] + 1 : end - 1], lines[end - 1]


def _consistent(block: list[str], summary: str) -> str | None:
    m = _PYTEST_LINE.match(summary)
    assert m is not None
    counts: dict[str, int] = {}
    for n, kind in _PYTEST_COUNT.findall(m.group("body")):
        key = "error" if kind.startswith("error") else kind
        counts[key] = counts.get(key, 0) + int(n)
    seen = {
        "passed": sum(ln.startswith("PASSED ") for ln in block),
        "failed": sum(ln.startswith("FAILED ") for ln in block),
        "error": sum(ln.startswith("ERROR ") for ln in block),
        "xfailed": sum(ln.startswith("XFAIL ") for ln in block),
        "xpassed": sum(ln.startswith("XPASS ") for ln in block),
        "skipped": sum(int(s.group(1)) for ln in block if (s := _SKIPPED.match(ln))),
    }
    for kind, n in seen.items():
        if n != counts.get(kind, 0):
            return f"pytest's summary says {counts.get(kind, 0)} {kind}, its short summary lists {n}"
    return None


def log_problem(
    log: str,
    spec: TestSpec,
    parser: str,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    eval_type: str,
) -> str | None:
    """Why the log cannot back a resolved verdict, or None."""
    from swebench.harness.constants import END_TEST_OUTPUT, FAIL_TO_PASS, PASS_TO_PASS, START_TEST_OUTPUT
    from swebench.harness.grading import get_eval_tests_report, get_resolution_status
    from swebench.harness.log_parsers import PARSER_REGISTRY

    starts, ends = log.count(START_TEST_OUTPUT), log.count(END_TEST_OUTPUT)
    if starts != 1 or ends != 1 or log.index(START_TEST_OUTPUT) > log.index(END_TEST_OUTPUT):
        return f"the test markers appear {starts} and {ends} times (the tests printed them)"
    if parser not in PYTEST_FORMAT:
        return None
    sliced = log.split(START_TEST_OUTPUT, 1)[1].split(END_TEST_OUTPUT, 1)[0]
    found = _block(sliced)
    if isinstance(found, str):
        return found
    block, summary = found
    problem = _consistent(block, summary)
    if problem is not None:
        return problem
    statuses = PARSER_REGISTRY[parser]("\n".join(block), spec)
    gold = {FAIL_TO_PASS: list(fail_to_pass), PASS_TO_PASS: list(pass_to_pass)}
    from swebench.harness.constants import EvalType, ResolvedStatus

    report = get_eval_tests_report(statuses, gold, eval_type=EvalType(eval_type))
    if get_resolution_status(report) != ResolvedStatus.FULL.value:
        return (
            "pytest's own short summary does not resolve the instance (status lines were printed elsewhere)"
        )
    return None
