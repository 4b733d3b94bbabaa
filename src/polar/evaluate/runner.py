"""The trusted runner, host side: start `trusted_runner.py` in the fresh runtime and judge its report.

The verdict comes from the task, never from what the tested code prints or writes:
- the expected test ids are collected in the fresh runtime *before* the diff is applied (only the task's
  code runs then), or named by the task (`expected_tests`); a run with any of them missing is a 0;
- the runner is the task's interpreter, resolved before the diff to an absolute path, in isolated mode;
- the report is read only between nonce-delimited lines on a private stdout (the nonce goes in on stdin,
  per evaluation), so printed text and files written beforehand cannot pose as it; a process that exits
  early (`os._exit(0)`, `SystemExit` at import) leaves no report: a 0;
- a canary test that must fail, and a comparison of the framework's functions with the objects recorded
  before any task or agent code was imported, catch tested code that disables failures.

What it cannot prove: code in the test process that reads the nonce from the runner's memory, or that
targets only the task's tests and puts the framework back before the end. See docs/security.md.
"""

from __future__ import annotations

import ast
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar.evaluate.support import EvaluatorError, output_of, tail
from polar.runtime.base import ExecResult, Runtime

RUNNER = (Path(__file__).with_name("trusted_runner.py")).read_text()
# A path that can never exist (/dev/null is no directory): no bytecode is read from any __pycache__ or
# written anywhere, in the runner (-X pycache_prefix) or in the Python processes the tests start.
PYCACHE_PREFIX = "/dev/null/polar-pycache"
# What every test command (and each Python process the tests start) gets. Not PYTHONSAFEPATH: commands such
# as `python3 -c "import solution"` or `python3 tests/run.py` rely on the directory they name; the review
# refuses the shadowing modules it guards against, and the runner itself runs with -I (which implies it).
ISOLATED_ENV = {
    "PYTHONNOUSERSITE": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONPYCACHEPREFIX": PYCACHE_PREFIX,
    "PYTHONPATH": "",  # CPython reads an empty variable as unset
    "PYTHONSTARTUP": "",
    "PYTHONHOME": "",
    "PYTHONINSPECT": "",
}


def isolated_env(runtime_env: Mapping[str, str], task_env: Mapping[str, str]) -> dict[str, str]:
    """ISOLATED_ENV minus what the task's runtime sets itself, then the evaluator's own `env`."""
    return {k: v for k, v in ISOLATED_ENV.items() if k not in runtime_env} | dict(task_env)


@dataclass
class Report:
    tests: dict[str, str] = field(default_factory=dict)  # collect: id -> "", "skip" or "xfail" (static)
    results: dict[str, str] = field(
        default_factory=dict
    )  # run: id -> passed/failed/error/skipped/xfail/xpass
    files: list[str] = field(default_factory=list)  # the collected tests' files, relative to the workdir
    load_errors: list[str] = field(default_factory=list)
    canary: str | None = None
    tampered: list[str] = field(default_factory=list)
    error: str | None = None


def parse_report(stdout: str, nonce: str) -> Report | None:
    """The report between `<nonce> BEGIN` and `<nonce> END`, or None when there is none, more than one, or
    any line in it is malformed (the runner writes nothing else there)."""
    lines = stdout.splitlines()
    begin = [i for i, ln in enumerate(lines) if ln == f"{nonce} BEGIN"]
    end = [i for i, ln in enumerate(lines) if ln == f"{nonce} END"]
    if len(begin) != 1 or len(end) != 1 or begin[0] > end[0]:
        return None
    report = Report()
    prefix = nonce + " "
    for line in lines[begin[0] + 1 : end[0]]:
        if not line.startswith(prefix):
            return None
        kind, _, rest = line[len(prefix) :].partition(" ")
        try:
            values = ast.literal_eval(f"[{rest}]")
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None
        if not all(isinstance(v, str) for v in values):
            return None
        match kind, values:
            case "TEST", [tid, static] if static in ("", "skip", "xfail"):
                report.tests[tid] = static
            case "RESULT", [tid, status] if status in (
                "passed",
                "failed",
                "error",
                "skipped",
                "xfail",
                "xpass",
            ):
                report.results[tid] = status
            case "FILE", [path]:
                report.files.append(path)
            case "LOADERROR", [where, text]:
                report.load_errors.append(f"{where}: {text}" if where else text)
            case "CANARY", [status]:
                report.canary = status
            case "TAMPER", [name]:
                report.tampered.append(name)
            case "ERROR", [text]:
                report.error = text
            case _:
                return None
    return report


@dataclass(frozen=True)
class RunnerJob:
    runner: str  # unittest | pytest
    python: str  # absolute, resolved before the diff
    tests: Sequence[str]
    pattern: str
    pythonpath: Sequence[str]
    env: Mapping[str, str]
    timeout_s: float | None


async def run_runner(
    fresh: Runtime, job: RunnerJob, mode: str, expected: Sequence[str] = ()
) -> tuple[ExecResult, Report | None]:
    nonce = secrets.token_hex(16)
    payload = {
        "runner": job.runner,
        "mode": mode,
        "tests": list(job.tests),
        "pattern": job.pattern,
        "pythonpath": list(job.pythonpath),
        "expected": list(expected),
        "canary": secrets.token_hex(4),
    }
    argv = [job.python, "-I", "-B", "-X", f"pycache_prefix={PYCACHE_PREFIX}", "-c", RUNNER, mode]
    stdin = f"{nonce}\n{json.dumps(payload)}".encode()
    res = await fresh.exec(argv, stdin=stdin, env=dict(job.env), timeout_s=job.timeout_s)
    return res, parse_report(res.stdout, nonce)


async def resolve_python(fresh: Runtime, python: str, timeout_s: float) -> str:
    """The interpreter's absolute path in the fresh runtime, looked up before the diff is applied (a diff
    cannot put a `python3` earlier on PATH)."""
    res = await fresh.exec(["bash", "-c", 'command -v -- "$1"', "polar", python], timeout_s=timeout_s)
    path = res.stdout.strip()
    if res.exit_code != 0 or not path.startswith("/"):
        raise EvaluatorError(
            f"evaluator.config.python: {python!r} is not an executable in the fresh runtime "
            f"(exit {res.exit_code}): {tail(res.stderr.strip(), 300)}"
        )
    return path


@dataclass(frozen=True)
class Collected:
    expected: dict[str, str]  # id -> static skip/xfail marker ("" counts)
    files: list[str]


async def collect(fresh: Runtime, job: RunnerJob) -> Collected:
    """The task's test ids, collected in the fresh runtime before the diff is applied."""
    res, report = await run_runner(fresh, job, "collect")
    where = f"collecting the task's {job.runner} tests before the diff"
    if res.timed_out:
        raise EvaluatorError(f"{where} timed out")
    if report is None:
        raise EvaluatorError(f"{where} gave no report (exit {res.exit_code}): {tail(output_of(res), 1000)}")
    if report.error is not None or report.load_errors:
        problem = report.error or "; ".join(report.load_errors[:3])
        raise EvaluatorError(
            f"{where} failed: {tail(problem, 1000)} (name the tests in evaluator.config.expected_tests "
            "when they cannot load before the fix)"
        )
    if not any(static == "" for static in report.tests.values()):
        raise EvaluatorError(f"{where}: no test to count (collected {len(report.tests)}, all skipped)")
    return Collected(expected=report.tests, files=report.files)


@dataclass(frozen=True)
class Verdict:
    reward: float
    passed: bool
    details: dict[str, Any]


def judge(
    expected: Mapping[str, str], report: Report | None, *, allow_skips: bool = False, fraction: bool = True
) -> Verdict:
    """The reward for a run against the expected tests (id -> static marker from the collection): the
    passed fraction, or with `fraction=False` 1 only when every counted test passed."""
    if report is None:
        return Verdict(0.0, False, {"reason": "the test runner left no report (the process exited early)"})
    if report.error is not None:
        return Verdict(0.0, False, {"reason": f"the test runner failed: {tail(report.error, 500)}"})
    if report.tampered or report.canary != "failed":
        return Verdict(
            0.0,
            False,
            {
                "reason": "the tested code tampered with the test runner",
                "tampered": report.tampered[:50],
                "canary": report.canary,
            },
        )
    missing = [t for t in expected if t not in report.results]
    if missing:
        return Verdict(
            0.0,
            False,
            {
                "reason": f"{len(missing)} of {len(expected)} expected tests did not run",
                "missing": missing[:50],
            },
        )
    counted = [t for t, static in expected.items() if static == ""]
    if allow_skips:
        counted = [t for t in counted if report.results[t] != "skipped"]
    ok = [t for t in counted if report.results[t] == "passed"]
    failed = [t for t in counted if report.results[t] != "passed"]
    passed = bool(counted) and not failed
    share = len(ok) / len(counted) if counted else 0.0
    details: dict[str, Any] = {
        "reason": f"{len(ok)}/{len(counted)} tests passed",
        "tests_passed": len(ok),
        "tests_failed": len(failed),
        "tests_ignored": len(expected) - len(counted),
    }
    if failed:
        details["failed"] = [f"{t} ({report.results[t]})" for t in failed[:50]]
    return Verdict(share if fraction else float(passed), passed, details)
