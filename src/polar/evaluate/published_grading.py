"""The grading rules of SWE-smith and R2E-Gym, applied to the log of the `swebench` evaluator's eval script.

Both publishers grade with code that cannot run beside swebench 5.x (swesmith imports swebench 4's API;
R2E-Gym's `r2egym` is not on the package index), so their rules are written here from their sources:

- SWE-smith (swesmith 0.0.9, `harness/grading.py` and `profiles/python.py`): the test output is what lies
  between the traced `+ : '>>>>> Start Test Output'` and `+ : '>>>>> End Test Output'` lines; a Python
  profile's parser maps each line `<test> <STATUS>` (`pytest --verbose`) to that status; the instance is
  resolved when every FAIL_TO_PASS and PASS_TO_PASS test passes, judged by the installed swebench's
  `get_eval_tests_report` and `get_resolution_status` (which, unlike swesmith's copy of them, count a
  skipped FAIL_TO_PASS test as a failure).
- R2E-Gym (`agenthub/runtime/docker.py` `_calculate_reward_r2e`, `repo_analysis/execution_log_parser.py`):
  ANSI codes and carriage returns are removed from `run_tests.sh`'s output; after its "short test summary
  info" line, each line with PASSED, FAILED or ERROR gives the test named by its `::` parts after the file,
  joined by ".", cut at " - "; the reward is 1 when these statuses equal `expected_output_json` exactly
  (same tests, same statuses, keys cut at " - " on both sides).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_SWESMITH_START = "+ : '>>>>> Start Test Output'"
_SWESMITH_END = "+ : '>>>>> End Test Output'"
_STATUSES = ("FAILED", "PASSED", "SKIPPED", "ERROR", "XFAIL")
_ANSI_CR = re.compile(r"\x1b\[[0-9;]*m|\r")
_COLOR = re.compile(r"\x1b\[\d+m")


def swesmith_statuses(log: str) -> dict[str, str] | None:
    """The statuses SWE-smith's Python profiles read from the log, or None when the markers are missing."""
    start, end = log.find(_SWESMITH_START), log.find(_SWESMITH_END)
    if start < 0 or end < 0 or start > end:
        return None
    statuses: dict[str, str] = {}
    for line in log[start + len(_SWESMITH_START) : end].split("\n"):
        for status in _STATUSES:
            found = re.match(rf"^(\S+)(\s+){status}", line)
            if found:
                statuses[found.group(1)] = status
    return statuses


def swesmith_resolved(
    statuses: Mapping[str, str], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]
) -> tuple[bool, dict[str, object]]:
    """(resolved, the per-test report) by the installed swebench's rule."""
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS, EvalType, ResolvedStatus
    from swebench.harness.grading import get_eval_tests_report, get_resolution_status

    gold = {FAIL_TO_PASS: list(fail_to_pass), PASS_TO_PASS: list(pass_to_pass)}
    report = get_eval_tests_report(dict(statuses), gold, eval_type=EvalType.PASS_AND_FAIL)
    return get_resolution_status(report) == ResolvedStatus.FULL.value, dict(report)


def r2e_statuses(output: str) -> dict[str, str]:
    """R2E-Gym's statuses of a `run_tests.sh` output (its pytest parser, keys decolored and cut)."""
    text = _ANSI_CR.sub("", output)
    statuses: dict[str, str] = {}
    if "short test summary info" not in text:
        return statuses
    for line in text.split("short test summary info")[1].strip().split("\n"):
        for status in ("PASSED", "FAILED", "ERROR"):
            if status in line:
                name = ".".join(line.split("::")[1:])
                statuses[name.split(" - ")[0] if status != "PASSED" else name] = status
                break
    return {_COLOR.sub("", k).split(" - ")[0]: v for k, v in statuses.items()}


def r2e_matches(statuses: Mapping[str, str], expected: Mapping[str, str]) -> tuple[bool, list[str]]:
    """(R2E-Gym's reward is 1, the tests that differ)."""
    want = {_COLOR.sub("", k).split(" - ")[0]: v for k, v in expected.items()}
    differ = sorted(k for k in want.keys() | statuses.keys() if want.get(k) != statuses.get(k))
    return (len(want) == len(statuses) and not differ), differ
