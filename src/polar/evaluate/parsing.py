"""Pass fractions from test runners' summary lines, for evaluators that reward partial success.

Only the final summary is read (the last one in the output wins, so a test that prints a look-alike line
earlier cannot fake its score). Skipped and expected-failure tests count on neither side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# pytest's terminal summary, with or without `=` borders (-q drops them), e.g.
# "== 2 failed, 1 passed, 1 skipped in 0.77s ==" / "1 error in 0.78s" / "no tests ran in 0.01s";
# pytest >= 7 may add the wall time as "(0:01:02)".
_PYTEST_LINE = re.compile(r"^=*\s*(?P<body>.*?)\s+in\s+[\d.]+s(?:\s+\([\d:]+\))?\s*=*\s*$")
_PYTEST_COUNT = re.compile(
    r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?|rerun)"
)
# unittest: "Ran 5 tests in 0.001s" then "OK", "OK (skipped=1)" or "FAILED (failures=1, errors=1, ...)".
_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in [\d.]+s$")
_UNITTEST_COUNT = re.compile(r"(failures|errors|skipped|expected failures|unexpected successes)=(\d+)")


@dataclass(frozen=True)
class RunCounts:
    passed: int
    failed: int  # failures, errors and (unittest) unexpected successes
    ignored: int  # skipped, xfailed, xpassed, expected failures

    @property
    def fraction(self) -> float:
        total = self.passed + self.failed
        return self.passed / total if total else 0.0


def parse_pytest(output: str) -> RunCounts | None:
    """Counts from pytest's last summary line, or None when there is none."""
    for line in reversed(_lines(output)):
        m = _PYTEST_LINE.match(line)
        if m is None:
            continue
        body = m.group("body")
        counts: dict[str, int] = {}
        for n, kind in _PYTEST_COUNT.findall(body):
            key = "error" if kind.startswith("error") else kind
            counts[key] = counts.get(key, 0) + int(n)
        if not counts and "no tests ran" not in body:
            continue
        return RunCounts(
            passed=counts.get("passed", 0),
            failed=counts.get("failed", 0) + counts.get("error", 0),
            ignored=counts.get("skipped", 0) + counts.get("xfailed", 0) + counts.get("xpassed", 0),
        )
    return None


def parse_unittest(output: str) -> RunCounts | None:
    """Counts from unittest's last "Ran N tests" block, or None when there is none."""
    lines = _lines(output)
    for i in range(len(lines) - 1, -1, -1):
        m = _UNITTEST_RAN.match(lines[i])
        if m is None:
            continue
        ran = int(m.group(1))
        verdict = next((ln for ln in lines[i + 1 :] if ln), "")
        if not verdict.startswith(("OK", "FAILED", "NO TESTS RAN")):
            return None
        c = {k: int(v) for k, v in _UNITTEST_COUNT.findall(verdict)}
        ignored = c.get("skipped", 0) + c.get("expected failures", 0)
        failed = c.get("failures", 0) + c.get("errors", 0) + c.get("unexpected successes", 0)
        # Errors in setUpClass/module imports are counted without being among the tests "Ran".
        passed = max(ran - ignored - failed, 0)
        return RunCounts(passed=passed, failed=failed, ignored=ignored)
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _lines(output: str) -> list[str]:
    # `--color=yes` (or FORCE_COLOR) wraps the summary in ANSI escapes.
    return [ln.strip() for ln in _ANSI.sub("", output).splitlines()]


PARSERS = {"pytest": parse_pytest, "unittest": parse_unittest}
