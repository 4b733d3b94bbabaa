"""What the built-in evaluators share: strict configs validated at submit time, and telling the agent's
failures (reward 0) from the environment's (raise: the session becomes ERROR and is fully masked)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from polar.runtime.base import ExecResult, Runtime

OUTPUT_TAIL = 2000  # characters of command output kept in `EvalResult.details`
# bash: 126 "found but not executable", 127 "command not found": the runtime lacks what the check needs,
# which no agent action in the workdir explains.
ENVIRONMENT_EXIT_CODES = frozenset({126, 127})


class EvaluatorError(Exception):
    """The evaluation itself failed (not the agent): the node records ERROR and masks the session."""


class StrictConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


C = TypeVar("C", bound=StrictConfig)


def parse_config(evaluator: str, model: type[C], config: Mapping[str, Any] | None) -> C:
    """`config` validated into `model`, or a ValueError naming the evaluator and the field."""
    try:
        return model.model_validate(dict(config or {}))
    except ValidationError as exc:
        from polar.hints import validation_problem

        loc, message = validation_problem(exc, model)  # a misspelt key, with the closest one
        where = ".".join(["evaluator.config", *(str(p) for p in loc)])
        raise ValueError(f"evaluator {evaluator!r}: {where}: {message}") from None


def inside_workdir(paths: list[str]) -> list[str]:
    """`paths` when each is relative to the workdir and climbs out of it nowhere (a config field's check)."""
    for path in paths:
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"{path!r} must be a path inside the workdir (relative, no '..')")
    return paths


def tail(text: str, n: int = OUTPUT_TAIL) -> str:
    return text if len(text) <= n else "…" + text[-n:]


def output_of(result: ExecResult) -> str:
    """stdout then stderr (unittest reports on stderr, pytest on stdout)."""
    if result.stdout and result.stderr:
        return f"{result.stdout}\n{result.stderr}"
    return result.stdout or result.stderr


def require_environment(result: ExecResult, what: str) -> None:
    """Raise `EvaluatorError` when `result` says the runtime could not run `what` at all."""
    if result.exit_code in ENVIRONMENT_EXIT_CODES and not result.timed_out:
        raise EvaluatorError(
            f"{what} could not run in the runtime (exit {result.exit_code}): {tail(result.stderr, 500)}"
        )


# Kill every process but PID 1 (the container's init), its oldest child (the container's main process)
# and this script's own ancestry: what the agent left behind must not outlive its turn.
SWEEP = r"""
keep=" 1 "
kids=($(cat /proc/1/task/1/children 2>/dev/null))
if [ ${#kids[@]} -gt 0 ]; then keep="$keep$(printf '%s\n' "${kids[@]}" | sort -n | head -n1) "; fi
p=$$
while [ -n "$p" ] && [ "$p" -gt 0 ]; do
  keep="$keep$p "
  p=$(while read -r k v; do [ "$k" = PPid: ] && echo "$v"; done < /proc/$p/status)
done
for round in 1 2 3; do
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    case "$keep" in *" $pid "*) ;; *) kill -9 "$pid" 2>/dev/null ;; esac
  done
done
true
"""


async def stop_leftovers(runtime: Runtime) -> None:
    """Kill what the agent left running in its own runtime before a check runs there (a leftover could
    rewrite what the check reads). In a container, every process but its init and main process; local and
    bwrap need nothing: each command runs in its own PID namespace, which dies with it."""
    if runtime.spec.backend in ("docker", "podman"):
        res = await runtime.exec(["bash", "-c", SWEEP], cwd="/", timeout_s=120)
        require_environment(res, "stopping the agent's processes")
