"""`test_on_output`: run a check in the agent's own runtime once it finished.

For tasks whose result is the state the agent left (a file it wrote, a program's output) rather than a
diff to replay. Reward 1 when the check exits 0 and, with `expect`, its output matches.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from polar.evaluate.base import EvalContext, EvalResult
from polar.evaluate.support import StrictConfig, parse_config, require_environment, tail
from polar.runtime.base import ExecResult


class TestOnOutputConfig(StrictConfig):
    __test__ = False  # not a pytest test class despite the name

    command: str = Field(min_length=1)
    timeout_seconds: float | None = Field(None, gt=0)
    expect: str | None = None
    match: Literal["exact", "contains", "regex"] = "exact"  # exact compares with surrounding blanks stripped
    stream: Literal["stdout", "stderr", "both"] = "stdout"
    env: dict[str, str] = Field(default_factory=dict)

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
        cfg = self.config
        run = await ctx.runtime.exec(cfg.command, timeout_s=cfg.timeout_seconds, env=cfg.env or None)
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
