"""`command`: apply the agent's diff in a fresh runtime and run the task's tests there.

Tests run in a runtime prepared from the task while the agent ran (never the agent's own), so nothing the
agent left behind (a patched test runner, a running server) can change the verdict; only its diff travels.
The diff is taken against `base_ref` (default `HEAD`, which the task's prepare actions committed) with every
change staged, new files and binaries included, build products (`__pycache__/`, `*.pyc`, `*.pyo`) left out,
and moved as a file, byte for byte (command output is decoded text and capped).

Then, before anything of the tree runs:
- the diff is **reviewed** (`polar.evaluate.review`) and refused (reward 0, `reason` "refused: ...") when it
  touches `protect` (and, with `runner`, the collected test files), adds an import hook (`conftest.py`,
  `sitecustomize.py`, `*.pth`, ...) or a runner configuration file, a top-level module named like a
  standard-library or test-framework module, or a symlink out of the repository or into a protected path;
- the protected paths are checked out of `base_ref` again.

The verdict, two ways:
- `runner: unittest | pytest` (recommended): polar starts the runner itself, with the task's interpreter in
  isolated mode, and reads a report the tested code cannot forge, checked against the test ids collected
  before the diff was applied (`polar.evaluate.runner`);
- `test_command` (any command, e.g. `make test`): its exit code, or with `parse` its printed summary. The
  command runs the agent's code, so its exit code and output are trusted as they are: a diff that stays
  within the review can still end the process with status 0 or print a passing summary.
Every command gets the isolated Python environment of `polar.evaluate.runner.ISOLATED_ENV`.

Whose fault: an empty diff, a refused diff, a diff that does not apply, failing or hanging tests are the
agent's (reward 0). A runtime that cannot run git or the tests, tests that cannot be collected before the
diff, or an agent workdir that is no longer a git repository, are not (raise: ERROR, fully masked).
"""

from __future__ import annotations

import posixpath
import shlex
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from polar.evaluate import review
from polar.evaluate.base import AgentFault, EvalContext, EvalResult
from polar.evaluate.container_review import system_changes
from polar.evaluate.parsing import PARSERS
from polar.evaluate.runner import RunnerJob, collect, isolated_env, judge, resolve_python, run_runner
from polar.evaluate.support import (
    ENVIRONMENT_EXIT_CODES,
    EvaluatorError,
    StrictConfig,
    output_of,
    parse_config,
    require_environment,
    tail,
)
from polar.runtime.base import Runtime
from polar.runtime.container import ContainerRuntime, ListingTruncated

# Inside the agent's git directory: never part of the diff, always writable, relative to the workdir.
_PATCH = ".git/polar-agent.patch"
# Flags that pin the diff's format whatever git config the runtime has (diff.noprefix, color.ui=always,
# diff.external would each make `git apply` reject or misread it).
_DIFF = "git diff --cached --binary --no-color --no-ext-diff --src-prefix=a/ --dst-prefix=b/"


def diff_command(base_ref: str, protect: Sequence[str] = ()) -> str:
    """The shell command that writes the agent's staged changes against `base_ref` to `_PATCH`, leaving
    out build products and the `protect` pathspecs."""
    specs = " ".join(shlex.quote(s) for s in [*review.BUILD_PRODUCTS, *(f":(exclude){p}" for p in protect)])
    return f"git add -A && {_DIFF} {shlex.quote(base_ref)} -- . {specs} > {_PATCH}"


async def agent_diff(runtime: Runtime, base_ref: str, protect: Sequence[str], timeout_s: float) -> bytes:
    """The agent's changes in `runtime`'s workdir against `base_ref` (minus `protect`), byte for byte.

    Taken in the agent's own runtime, after it finished: a workdir it made undiffable (`.git` removed or
    corrupted, `base_ref` deleted, files git cannot read, more than git can add in time) is its doing
    (`AgentFault`, reward 0). Only a runtime where the diff could not start at all, with the agent's
    changes not to blame, is the evaluation's failure."""
    res = await runtime.exec(diff_command(base_ref, protect), timeout_s=timeout_s)
    if res.exit_code in ENVIRONMENT_EXIT_CODES and not res.timed_out:
        if broken := await _broken_by_agent(runtime, timeout_s):
            raise AgentFault(f"the agent's runtime cannot take its diff (exit {res.exit_code}): {broken}")
        require_environment(res, "the agent's diff")
    if res.timed_out:
        raise AgentFault(f"taking the agent's diff took more than {timeout_s:g} s (git add of its workdir)")
    if res.exit_code != 0:
        raise AgentFault(
            f"the agent's workdir gives no diff (exit {res.exit_code}): {tail(res.stderr.strip(), 500)}"
        )
    with tempfile.TemporaryDirectory(prefix="polar-eval-") as tmp:
        local = Path(tmp) / "agent.patch"
        await runtime.download(_PATCH, local)
        return local.read_bytes()


_RUNNER_ONLY = ("python", "tests", "pattern", "expected_tests", "allow_skips", "score")


class CommandConfig(StrictConfig):
    # Exactly one of the two: polar runs the tests itself (`runner`), or a command does (`test_command`).
    runner: Literal["unittest", "pytest"] | None = None
    test_command: str | None = Field(None, min_length=1)
    timeout_seconds: float | None = Field(None, gt=0)
    # With test_command: how its result is read.
    parse: Literal["exit_code", "pytest", "unittest"] = "exit_code"
    # With runner: the task's interpreter; what to run (unittest: start directories or dotted names, default
    # discovery from the workdir as `python -m unittest` does; pytest: its arguments); the tests that must
    # run (default: collected before the diff is applied); whether a test skipped at run time is left out
    # of the count rather than failed (the code under test can raise SkipTest).
    python: str = Field("python3", min_length=1)
    tests: list[str] = Field(default_factory=list)
    pattern: str = Field("test*.py", min_length=1)
    expected_tests: list[str] | None = Field(None, min_length=1)
    allow_skips: bool = False
    # With runner: 1 only when every counted test passed ("all"), or the passed fraction ("fraction").
    score: Literal["all", "fraction"] = "all"
    base_ref: str = Field("HEAD", min_length=1)
    # Pathspecs the diff may not touch (the tests, what they read): such a diff is refused.
    protect: list[str] = Field(default_factory=list)
    # Runner configuration files the diff may not add or change.
    config_files: list[str] = Field(default_factory=lambda: list(review.CONFIG_FILES))
    env: dict[str, str] = Field(default_factory=dict)
    git_timeout_seconds: float = Field(120.0, gt=0)

    @field_validator("base_ref")
    @classmethod
    def _not_an_option(cls, v: str) -> str:
        if v.startswith("-"):
            raise ValueError("must name a revision, not an option")
        return v

    @model_validator(mode="after")
    def _one_way(self) -> CommandConfig:
        if (self.runner is None) == (self.test_command is None):
            raise ValueError(
                "set exactly one of `runner` (unittest or pytest, run by polar with a report the tests "
                "cannot forge: recommended) and `test_command` (a command whose exit code or output counts)"
            )
        if self.runner is not None and "parse" in self.model_fields_set:
            raise ValueError(
                "`parse` reads a test_command's output; with `runner` the runner's report counts"
            )
        if self.runner is None:
            extra = sorted(set(_RUNNER_ONLY) & self.model_fields_set)
            if extra:
                raise ValueError(f"{', '.join(extra)} only apply with `runner`")
        return self


async def _broken_by_agent(runtime: Runtime, timeout_s: float) -> str | None:
    """What the agent broke that keeps a command from starting in its runtime: its workdir (removed,
    chmod 000), or, in a container where it may be root, a system command or library it changed."""
    res = await runtime.exec(["true"], timeout_s=timeout_s)
    if res.exit_code != 0 or res.timed_out:
        return "its workdir cannot be entered"
    if isinstance(runtime, ContainerRuntime):
        try:
            changed = system_changes(await runtime.changed_paths(), runtime.runtime_path(runtime.workdir))
        except ListingTruncated:
            return "it changed more paths than can be listed"
        if changed:
            return f"it changed {', '.join(changed[:5])}"
    return None


class CommandEvaluator:
    name = "command"
    needs_fresh_runtime = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = parse_config(self.name, CommandConfig, config)

    async def take_diff(self, runtime: Runtime) -> bytes:
        """The agent's changes against `base_ref`, as bytes `git apply` takes (protected paths included:
        the review refuses them)."""
        cfg = self.config
        return await agent_diff(runtime, cfg.base_ref, (), cfg.git_timeout_seconds)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        fresh = ctx.fresh
        if fresh is None:
            raise EvaluatorError(
                "evaluator 'command' needs a fresh runtime (the task's evaluator.fresh_runtime must not be false)"
            )
        cfg = self.config
        git_s = cfg.git_timeout_seconds
        # The task's repository first: what it lacks is the task's fault, what the agent's lacks, the agent's.
        ref = f"{cfg.base_ref}^{{commit}}"
        check = await fresh.exec(["git", "rev-parse", "--git-dir", "--verify", ref], timeout_s=git_s)
        require_environment(check, "git")
        if check.exit_code != 0:
            raise EvaluatorError(
                f"the fresh runtime's workdir is not a git repository with base_ref {cfg.base_ref!r}: "
                f"{tail(check.stderr.strip(), 500)}"
            )
        diff = await self.take_diff(ctx.runtime)
        if not diff.strip():
            return EvalResult(reward=0.0, passed=False, details={"reason": "no changes"})
        details: dict[str, Any] = {"diff_bytes": len(diff)}
        env = isolated_env(fresh.spec.env, cfg.env)
        # Before the diff, only the task's code runs: the interpreter, the test ids and their files.
        job, expected, protect = None, {}, list(cfg.protect)
        if cfg.runner is not None:
            job = RunnerJob(
                runner=cfg.runner,
                python=await resolve_python(fresh, cfg.python, git_s),
                tests=cfg.tests,
                pattern=cfg.pattern,
                pythonpath=[
                    p
                    for p in (cfg.env.get("PYTHONPATH") or fresh.spec.env.get("PYTHONPATH") or "").split(":")
                    if p
                ],
                env=env,
                timeout_s=cfg.timeout_seconds,
            )
            if cfg.expected_tests is not None:
                expected = dict.fromkeys(cfg.expected_tests, "")
            else:
                collected = await collect(fresh, job)
                expected = collected.expected
                protect += [f":(literal){f}" for f in collected.files]
            protect += self._interpreter_home(fresh, job.python)
        start = await review.before(fresh, git_s)

        applied = await fresh.exec(["git", "apply", "--whitespace=nowarn", "-"], stdin=diff, timeout_s=git_s)
        require_environment(applied, "git apply")
        if applied.timed_out:  # applying a diff git itself made does not hang; the runtime does
            raise EvaluatorError(f"git apply timed out after {git_s:g} s")
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
        tree = await review.inspect(fresh, start, protect, git_s)
        findings = review.review(tree, cfg.config_files)
        if findings:
            return EvalResult(reward=0.0, passed=False, details=details | review.refused(findings))
        await review.restore(fresh, cfg.base_ref, protect, git_s)

        if job is not None:
            res, report = await run_runner(fresh, job, "run", list(expected))
            # The tests' own output (the runner points their stdout at stderr; its stdout is the report).
            details |= {"exit_code": res.exit_code, "output": tail(res.stderr)}
            if res.timed_out:
                return EvalResult(reward=0.0, passed=False, details={**details, "reason": "tests timed out"})
            verdict = judge(expected, report, allow_skips=cfg.allow_skips, fraction=cfg.score == "fraction")
            return EvalResult(reward=verdict.reward, passed=verdict.passed, details=details | verdict.details)
        return await self._command(fresh, env, details)

    @staticmethod
    def _interpreter_home(fresh: Runtime, python: str) -> list[str]:
        """An interpreter inside the workdir (a task's venv) is protected with its environment's root."""
        workdir = fresh.runtime_path(fresh.workdir).rstrip("/")
        if not python.startswith(workdir + "/"):
            return []
        rel = posixpath.relpath(python, workdir)
        home = posixpath.dirname(posixpath.dirname(rel)) or rel
        return [f":(literal){home}"]

    async def _command(self, fresh: Runtime, env: dict[str, str], details: dict[str, Any]) -> EvalResult:
        cfg = self.config
        assert cfg.test_command is not None
        run = await fresh.exec(cfg.test_command, timeout_s=cfg.timeout_seconds, env=env)
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
