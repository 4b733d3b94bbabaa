"""`swebench`: grade a session as SWE-bench does, with the official `swebench` package.

The agent's diff against the instance's `base_commit` is taken from its runtime, leaving out every file the
instance's `test_patch` touches (as in SWE-bench, whose eval script checks them out again: an agent that
edits, or adds a regression test to, the tests it will be judged by changes nothing) and build products.
In a fresh runtime of the same image the diff is applied (`git apply`, then `patch --fuzz=5` as SWE-bench's
harness does) and reviewed (`polar.evaluate.review`): a diff that adds or changes `conftest.py`,
`sitecustomize.py`, a `.pth`, a runner configuration file (`config_files`), a top-level module named like
a standard-library or test-framework module, or a symlink out of the repository or onto the test files is
refused (reward 0, "refused: ..."). Then the instance's `eval_script` runs (it checks out the test files,
applies `test_patch`, runs the tests between `>>>>> Start Test Output` and `>>>>> End Test Output`), and
the log is graded by `swebench.harness.grading.get_eval_report`: reward 1 when FAIL_TO_PASS now pass and
PASS_TO_PASS still do.

The log holds what the tested code prints too. Before a resolved verdict counts, polar checks that each
marker appears once, and, for pytest's log parsers, that nothing follows pytest's final summary line and
that the statuses in its last "short test summary info" block (the one pytest wrote, counted against that
summary line) also resolve the instance: status lines printed by the tests elsewhere, or after pytest
finished (an atexit hook), do not count. A test process that prints a complete, consistent fake summary
block in place of pytest's is beyond what a log can show; `command` with `runner: pytest` is the
tamper-evident alternative.

Whose fault: no diff, a diff that applies neither way, tests that fail or time out are the agent's
(reward 0, the reason and the per-test report in the details). A log swebench classifies as an environment
failure, a runtime without git or bash, or a missing `swebench` package are not (raise: ERROR, masked).

Instances use SWE-bench 5.x's fields (`image`, `log_parser`, `eval_type`, `eval_script` besides
`instance_id`, `repo`, `version`, `base_commit`, `test_patch`, `FAIL_TO_PASS`, `PASS_TO_PASS`), as
`polar.rollout.datasets` writes them into `evaluator.config.instance` for every published shape
(`polar.rollout.published`). Two more fields serve the shapes whose publishers grade otherwise: `test_files`
(paths left out of the diff besides the test_patch's) and `grading`: `swesmith` or `r2egym` read the same log
with their publisher's rule (`polar.evaluate.published_grading`; R2E-Gym's `expected_output`).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from polar.evaluate import published_grading, review
from polar.evaluate.base import EvalContext, EvalResult
from polar.evaluate.command import agent_diff
from polar.evaluate.support import (
    EvaluatorError,
    StrictConfig,
    parse_config,
    require_environment,
    tail,
)
from polar.evaluate.swebench_log import log_problem
from polar.jsontypes import JSON
from polar.runtime.base import RuntimeFailure

# Beside the working directory (in a SWE-bench image: /testbed's parent), never in the repository under test.
EVAL_LOG = "../.polar-swebench-eval.log"
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)", re.MULTILINE)


class SWEInstance(BaseModel):
    """The fields grading needs; datasets carry more (problem_statement, patch, hints...), kept as they are."""

    model_config = ConfigDict(extra="allow", frozen=True)

    instance_id: str = Field(min_length=1)
    repo: str = Field(min_length=1)
    version: str
    base_commit: str = Field(min_length=1)
    test_patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    log_parser: str = Field(min_length=1)
    eval_type: str = "pass_and_fail"
    eval_script: str = Field(min_length=1)
    image: str = ""
    test_files: list[str] = Field(default_factory=list)
    grading: Literal["swebench", "swesmith", "r2egym"] = "swebench"
    expected_output: dict[str, str] | None = None

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, v: JSON) -> JSON:
        # SWE-bench's hub datasets store both lists as JSON text.
        return json.loads(v) if isinstance(v, str) else v

    @field_validator("version", mode="before")
    @classmethod
    def _text(cls, v: JSON) -> JSON:
        return str(v) if isinstance(v, int | float) else v


class SWEBenchConfig(StrictConfig):
    instance: SWEInstance
    timeout_seconds: float = Field(1800.0, gt=0)  # the eval script (SWE-bench's default)
    git_timeout_seconds: float = Field(120.0, gt=0)
    # Runner configuration files the diff may not add or change (`[]` allows them).
    config_files: list[str] = Field(default_factory=lambda: list(review.CONFIG_FILES))


def patched_files(test_patch: str) -> list[str]:
    """The paths a patch touches (both sides of each `diff --git`), in order, once each."""
    seen: dict[str, None] = {}
    for a, b in _DIFF_FILE.findall(test_patch):
        seen.setdefault(a)
        seen.setdefault(b)
    return [p for p in seen if p != "/dev/null"]


class SWEBenchEvaluator:
    name = "swebench"
    needs_fresh_runtime = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = parse_config(self.name, SWEBenchConfig, config)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        fresh = ctx.fresh
        if fresh is None:
            raise EvaluatorError("evaluator 'swebench' needs a fresh runtime (evaluator.fresh_runtime)")
        try:
            from swebench.harness.grading import get_eval_report
            from swebench.harness.utils import make_test_spec
        except ImportError:
            raise EvaluatorError(
                "evaluator 'swebench' needs the swebench package on the node: pip install 'polar-rl[swe]'"
            ) from None
        cfg, inst = self.config, self.config.instance
        protected = list(dict.fromkeys([*patched_files(inst.test_patch), *inst.test_files]))
        diff = await agent_diff(ctx.runtime, inst.base_commit, protected, cfg.git_timeout_seconds)
        details: dict[str, Any] = {"instance_id": inst.instance_id, "diff_bytes": len(diff)}
        if not diff.strip():
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": "no changes"})

        start = await review.before(fresh, cfg.git_timeout_seconds)
        method = await self._apply(fresh, diff, details)
        if method is None:
            return EvalResult(reward=0.0, passed=False, details=details)
        details["applied_with"] = method
        tests = [f":(literal){p}" for p in protected]
        tree = await review.inspect(fresh, start, tests, cfg.git_timeout_seconds)
        findings = review.review(tree, cfg.config_files)
        if findings:
            return EvalResult(reward=0.0, passed=False, details=details | review.refused(findings))

        spec = make_test_spec(inst.model_dump())
        # The log goes to a file in the runtime, fetched whole: a command's captured output is capped (its
        # head kept), and a verbose test suite's end, with the `End Test Output` marker, must not be cut.
        run = await fresh.exec(
            ["bash", "-c", 'bash -s > "$1" 2>&1', "bash", EVAL_LOG],
            stdin=spec.eval_script.encode(),
            timeout_s=cfg.timeout_seconds,
        )
        require_environment(run, "the instance's eval script")
        prediction = {
            "instance_id": inst.instance_id,
            "model_name_or_path": "polar",
            "model_patch": diff.decode("utf-8", errors="replace"),
        }
        with tempfile.TemporaryDirectory(prefix="polar-swebench-") as tmp:
            log = Path(tmp) / "eval.log"  # swebench's grading reads a log file
            try:
                await fresh.download(EVAL_LOG, log)
            except RuntimeFailure as exc:
                raise EvaluatorError(
                    f"the evaluation log could not be fetched from the runtime: {exc}"
                ) from exc
            text = log.read_text(errors="replace")
            details["eval_log"] = tail(text)
            if run.timed_out:
                return EvalResult(reward=0.0, passed=False, details={**details, "reason": "tests timed out"})
            if inst.grading != "swebench":
                return self._publisher_grade(text, details)
            report = get_eval_report(spec, prediction, str(log), include_tests_status=True)[inst.instance_id]
        if report.get("infra_failure"):
            raise EvaluatorError(
                f"swebench classifies the evaluation log as an environment failure: "
                f"{report.get('infra_failure_reason', 'unknown')}"
            )
        resolved = bool(report.get("resolved"))
        details["tests_status"] = report.get("tests_status")
        if resolved:
            problem = log_problem(
                text, spec, inst.log_parser, inst.FAIL_TO_PASS, inst.PASS_TO_PASS, inst.eval_type
            )
            if problem is not None:
                details["reason"] = f"the evaluation log cannot be trusted: {problem}"
                return EvalResult(reward=0.0, passed=False, details=details)
        if not report.get("patch_successfully_applied"):
            reason = "no test results in the evaluation log"
        else:
            reason = "resolved" if resolved else "not resolved"
        return EvalResult(
            reward=1.0 if resolved else 0.0, passed=resolved, details={**details, "reason": reason}
        )

    def _publisher_grade(self, log: str, details: dict[str, Any]) -> EvalResult:
        """The verdict of SWE-smith's or R2E-Gym's own rule on the eval script's log."""
        inst = self.config.instance
        from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT

        if log.count(START_TEST_OUTPUT) != 1 or log.count(END_TEST_OUTPUT) != 1:
            reason = "the test markers do not appear once each (the tests printed them, or did not run)"
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": reason})
        if inst.grading == "swesmith":
            statuses = published_grading.swesmith_statuses(log)
            if statuses is None:
                return EvalResult(reward=0.0, passed=False, details={**details, "reason": "no test output"})
            resolved, report = published_grading.swesmith_resolved(
                statuses, inst.FAIL_TO_PASS, inst.PASS_TO_PASS
            )
            details["tests_status"] = report
        else:
            output = log.split(START_TEST_OUTPUT, 1)[1].split(END_TEST_OUTPUT, 1)[0]
            statuses = published_grading.r2e_statuses(output)
            resolved, differ = published_grading.r2e_matches(statuses, inst.expected_output or {})
            details["tests_status"] = statuses
            details["tests_differing"] = differ[:50]
        reason = "resolved" if resolved else "not resolved"
        return EvalResult(
            reward=1.0 if resolved else 0.0, passed=resolved, details={**details, "reason": reason}
        )

    async def _apply(self, fresh: Any, diff: bytes, details: dict[str, Any]) -> str | None:
        """Apply the agent's diff in the fresh runtime: "git apply", "patch", or None (details say why)."""
        timeout = self.config.git_timeout_seconds
        tried = []
        # `git apply` changes nothing unless every hunk applies; `patch` is the harness's fallback.
        for method, argv in (
            ("git apply", ["git", "apply", "--verbose", "--whitespace=nowarn", "-"]),
            ("patch", ["patch", "--batch", "--fuzz=5", "-p1", "--forward"]),
        ):
            res = await fresh.exec(argv, stdin=diff, timeout_s=timeout)
            require_environment(res, method)
            if res.exit_code == 0 and not res.timed_out:
                return method
            tried.append(f"{method}: {tail((res.stderr or res.stdout).strip(), 600)}")
        details["reason"] = "the diff does not apply"
        details["apply_output"] = "\n".join(tried)
        return None
