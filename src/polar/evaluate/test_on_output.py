"""`test_on_output`: run a check in the agent's own runtime once it finished.

For tasks whose result is the state the agent left (a file it wrote, a program's output) rather than a
diff to replay. Reward 1 when the check exits 0 and, with `expect`, its output matches.

By design the check trusts that state: the files, and in a container whatever the agent changed outside
its workdir (a replaced `/usr/bin/python3`). What the evaluator takes away first:
- the agent's leftover processes (in a container; local and bwrap commands die with their PID namespace);
- `remove_first`: files the check itself must produce, deleted before it runs, so a copy the agent wrote
  beforehand does not count;
- the agent's shell and Python start-up: the check runs under `bash --noprofile --norc` with HOME a fresh
  empty directory (no ~/.profile, ~/.bashrc, user site-packages or ~/.local/bin), no BASH_ENV or ENV, PATH
  without empty, relative or session-home entries (a `python3` in the workdir is not found first), and
  the isolated Python variables of `polar.evaluate.runner.ISOLATED_ENV` (no stale bytecode is read).
Tasks whose verdict must not depend on the agent's runtime should replay a diff with `command`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from polar.evaluate.base import EvalContext, EvalResult
from polar.evaluate.runner import isolated_env
from polar.evaluate.support import (
    EvaluatorError,
    StrictConfig,
    inside_workdir,
    parse_config,
    require_environment,
    stop_leftovers,
    tail,
)
from polar.runtime.base import ExecResult

# Runs the check: PATH cleaned, HOME fresh (unless the task sets it), then the task's command, never a
# start-up file of the agent's. 127 when the runtime cannot make a directory (an environment failure).
_CHECK = r"""
home=$1 fresh_home=$2 cmd=$3
set -f; IFS=:; keep=
for p in $PATH; do
  case "$p" in ""|[!/]*) continue ;; esac
  case "$p/" in "$home"/*) continue ;; esac
  keep=${keep:+$keep:}$p
done
unset IFS; set +f
export PATH=$keep
if [ "$fresh_home" = 1 ]; then
  HOME=$(mktemp -d "${TMPDIR:-/tmp}/polar-check-home.XXXXXX") || { echo "cannot make a fresh HOME" >&2; exit 127; }
  export HOME
fi
exec bash --noprofile --norc -c "$cmd"
"""
_CHECK_ENV = {"BASH_ENV": "", "ENV": ""}
# Deletes `remove_first`, never through a directory symlink that leaves the workdir (exit 3 names it).
_REMOVE = r"""
root=$(pwd -P)
for p; do
  parent=$(realpath -m -- "$(dirname -- "$p")") || exit 1
  case "$parent/" in "$root"/*) rm -rf -- "$p" || exit 1 ;; *) printf '%s' "$p"; exit 3 ;; esac
done
"""


class TestOnOutputConfig(StrictConfig):
    __test__ = False  # not a pytest test class despite the name

    command: str = Field(min_length=1)
    timeout_seconds: float | None = Field(None, gt=0)
    expect: str | None = None
    match: Literal["exact", "contains", "regex"] = "exact"  # exact compares with surrounding blanks stripped
    stream: Literal["stdout", "stderr", "both"] = "stdout"
    env: dict[str, str] = Field(default_factory=dict)
    # Paths (relative to the workdir) the check produces itself: deleted before it runs.
    remove_first: list[str] = Field(default_factory=list)

    @field_validator("remove_first")
    @classmethod
    def _inside_workdir(cls, v: list[str]) -> list[str]:
        return inside_workdir(v)

    @model_validator(mode="after")
    def _regex_compiles(self) -> TestOnOutputConfig:
        if self.match == "regex" and self.expect is not None:
            try:
                re.compile(self.expect)
            except re.error as exc:
                raise ValueError(f"expect is not a valid regex: {exc}") from None
        return self


def _text(result: ExecResult, stream: str) -> str:
    if stream == "stdout":
        return result.stdout
    if stream == "stderr":
        return result.stderr
    return result.stdout + result.stderr


class TestOnOutput:
    __test__ = False

    name = "test_on_output"
    needs_fresh_runtime = False

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = parse_config(self.name, TestOnOutputConfig, config)

    def _matches(self, text: str) -> bool:
        cfg = self.config
        assert cfg.expect is not None
        if cfg.match == "exact":
            return text.strip() == cfg.expect.strip()
        if cfg.match == "contains":
            return cfg.expect in text
        return re.search(cfg.expect, text) is not None

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        cfg, rt = self.config, ctx.runtime
        await stop_leftovers(rt)
        if cfg.remove_first:
            gone = await rt.exec(["bash", "-c", _REMOVE, "polar-remove", *cfg.remove_first], timeout_s=120)
            require_environment(gone, "removing evaluator.config.remove_first")
            if gone.exit_code == 3:
                reason = f"remove_first: {gone.stdout!r} leads out of the workdir through a symlink"
                return EvalResult(reward=0.0, passed=False, details={"reason": reason})
            if gone.exit_code != 0:
                raise EvaluatorError(f"cannot remove {cfg.remove_first}: {tail(gone.stderr.strip(), 500)}")
        env = {k: v for k, v in _CHECK_ENV.items() if k not in rt.spec.env} | isolated_env(
            rt.spec.env, cfg.env
        )
        fresh_home = "0" if "HOME" in cfg.env else "1"
        argv = ["bash", "--noprofile", "--norc", "-c", _CHECK, "polar-check"]
        argv += [rt.runtime_path(rt.home).rstrip("/"), fresh_home, cfg.command]
        run = await rt.exec(argv, timeout_s=cfg.timeout_seconds, env=env)
        require_environment(run, f"check {cfg.command!r}")
        text = _text(run, cfg.stream)
        details: dict[str, Any] = {"exit_code": run.exit_code, "output": tail(text)}
        if run.timed_out:
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": "check timed out"})
        if run.exit_code != 0:
            return EvalResult(
                reward=0.0, passed=False, details={**details, "reason": f"check exited {run.exit_code}"}
            )
        if cfg.expect is not None and not self._matches(text):
            return EvalResult(
                reward=0.0,
                passed=False,
                details={**details, "reason": f"output does not match ({cfg.match})"},
            )
        return EvalResult(reward=1.0, passed=True, details={**details, "reason": "check passed"})
