"""`command`: apply the agent's diff in a fresh runtime and run the task's tests there.

Tests run in a runtime prepared from the task while the agent ran (never the agent's own), so nothing the
agent left behind (a patched test runner, a stray conftest.py outside the diff's reach, a running server)
can change the verdict; only its diff travels. The diff is taken against `base_ref` (default `HEAD`,
which the task's prepare actions committed) with every change staged, new files and binaries included,
and moved as a file, byte for byte (command output is decoded text and capped).

Whose fault: an empty diff, a diff that does not apply, failing or hanging tests are the agent's (reward
0). A runtime that cannot run git or the test command, or an agent workdir that is no longer a git
repository, are not (raise: ERROR, fully masked).
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from polar.evaluate.base import EvalContext, EvalResult
from polar.evaluate.parsing import PARSERS
from polar.evaluate.support import (
    EvaluatorError,
    StrictConfig,
    output_of,
    parse_config,
    require_environment,
    tail,
)
from polar.runtime.base import Runtime

# Inside the agent's git directory: never part of the diff, always writable, relative to the workdir.
_PATCH = ".git/polar-agent.patch"
# Flags that pin the diff's format whatever git config the runtime has (diff.noprefix, color.ui=always,
# diff.external would each make `git apply` reject or misread it).
_DIFF = "git diff --cached --binary --no-color --no-ext-diff --src-prefix=a/ --dst-prefix=b/"


def diff_command(base_ref: str, protect: Sequence[str] = ()) -> str:
    """The shell command that writes the agent's staged changes against `base_ref` to `_PATCH`, leaving
    out the `protect` pathspecs."""
    specs = " ".join(shlex.quote(f":(exclude){p}") for p in protect)
    pathspec = f" -- . {specs}" if specs else ""
    return f"git add -A && {_DIFF} {shlex.quote(base_ref)}{pathspec} > {_PATCH}"


async def agent_diff(runtime: Runtime, base_ref: str, protect: Sequence[str], timeout_s: float) -> bytes:
    """The agent's changes in `runtime`'s workdir against `base_ref` (minus `protect`), byte for byte."""
    res = await runtime.exec(diff_command(base_ref, protect), timeout_s=timeout_s)
    if res.exit_code != 0 or res.timed_out:
        raise EvaluatorError(
            f"cannot take the agent's diff (exit {res.exit_code}): {tail(res.stderr.strip(), 500)}"
        )
    with tempfile.TemporaryDirectory(prefix="polar-eval-") as tmp:
        local = Path(tmp) / "agent.patch"
        await runtime.download(_PATCH, local)
        return local.read_bytes()


class CommandConfig(StrictConfig):
    test_command: str = Field(min_length=1)
    timeout_seconds: float | None = Field(None, gt=0)
    parse: Literal["exit_code", "pytest", "unittest"] = "exit_code"
    base_ref: str = Field("HEAD", min_length=1)
    # Pathspecs whose changes are dropped from the diff (e.g. the tests the agent must not edit).
    protect: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    git_timeout_seconds: float = Field(120.0, gt=0)

    @field_validator("base_ref")
    @classmethod
    def _not_an_option(cls, v: str) -> str:
        if v.startswith("-"):
            raise ValueError("must name a revision, not an option")
        return v


class CommandEvaluator:
    name = "command"
    needs_fresh_runtime = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = parse_config(self.name, CommandConfig, config)

    async def take_diff(self, runtime: Runtime) -> bytes:
        """The agent's changes against `base_ref`, as bytes `git apply` takes."""
        cfg = self.config
        return await agent_diff(runtime, cfg.base_ref, cfg.protect, cfg.git_timeout_seconds)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        fresh = ctx.fresh
        if fresh is None:
            raise EvaluatorError(
                "evaluator 'command' needs a fresh runtime (the task's evaluator.fresh_runtime must not be false)"
            )
        cfg = self.config
        diff = await self.take_diff(ctx.runtime)
        if not diff.strip():
            return EvalResult(reward=0.0, passed=False, details={"reason": "no changes"})
        details: dict[str, Any] = {"diff_bytes": len(diff)}

        check = await fresh.exec(["git", "rev-parse", "--git-dir"], timeout_s=cfg.git_timeout_seconds)
        require_environment(check, "git")
        if check.exit_code != 0:
            raise EvaluatorError(
                f"the fresh runtime's workdir is not a git repository: {tail(check.stderr.strip(), 500)}"
            )
        applied = await fresh.exec(
            ["git", "apply", "--whitespace=nowarn", "-"], stdin=diff, timeout_s=cfg.git_timeout_seconds
        )
        require_environment(applied, "git apply")
        if applied.timed_out:  # applying a diff git itself made does not hang; the runtime does
            raise EvaluatorError(f"git apply timed out after {cfg.git_timeout_seconds:g} s")
        if applied.exit_code != 0:
            return EvalResult(
                reward=0.0,
                passed=False,
                details={
                    **details,
                    "reason": "the diff does not apply",
                    "apply_output": tail(applied.stderr.strip()),
                },
            )

        run = await fresh.exec(cfg.test_command, timeout_s=cfg.timeout_seconds, env=cfg.env or None)
        require_environment(run, f"test command {cfg.test_command!r}")
        output = output_of(run)
        details |= {"exit_code": run.exit_code, "output": tail(output)}
        if run.timed_out:
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": "tests timed out"})
        passed = run.exit_code == 0
        if cfg.parse == "exit_code":
            reason = "tests passed" if passed else f"tests failed (exit {run.exit_code})"
            return EvalResult(
                reward=1.0 if passed else 0.0, passed=passed, details={**details, "reason": reason}
            )
        counts = PARSERS[cfg.parse](output)
        if counts is None:
            if passed:
                # Exit 0 without a summary: the command is not the runner `parse` names; guessing 1.0
                # would reward a misconfigured task.
                raise EvaluatorError(
                    f"test command exited 0 but printed no {cfg.parse} summary (evaluator.config.parse)"
                )
            return EvalResult(
                reward=0.0,
                passed=False,
                details={**details, "reason": f"no {cfg.parse} summary in the output"},
            )
        details |= {
            "tests_passed": counts.passed,
            "tests_failed": counts.failed,
            "tests_ignored": counts.ignored,
        }
        reason = f"{counts.passed}/{counts.passed + counts.failed} tests passed"
        return EvalResult(reward=counts.fraction, passed=passed, details={**details, "reason": reason})
