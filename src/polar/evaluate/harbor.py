"""`harbor`: run a Harbor task's verifier (`tests/test.sh`) and read the reward it writes.

As Harbor does: the tests are copied to `/tests` after the agent finished, `bash /tests/test.sh` runs in the
workdir, and the reward is `/logs/verifier/reward.json`'s `reward` (when that file exists) or the number in
`/logs/verifier/reward.txt`; the script's exit code does not count. `environment_mode`:

- `shared` (Harbor's default): in the agent's own container. Before the tests go in, every process the agent
  left running is killed (a leftover could rewrite the reward file), and `/tests` and `/logs/verifier` are
  emptied, so nothing the agent wrote there (a doctored test.sh, a reward.txt of 1) counts: the tests come
  from the task, as read on the trainer's side.
- `separate`: in the fresh container the node prepared from the task's image, which gets, as in Harbor, only
  `/logs/artifacts` and the paths the task lists in `artifacts`, copied from the agent's container.

What it trusts: the reward file the verifier writes, and so whatever the verifier runs. In `shared` mode that
is the agent's whole container outside `/tests` and `/logs/verifier`: a replaced `python3`, or a `pytest.py`
or `conftest.py` where the verifier runs `python3 -m pytest`, decides the reward (tests/security/
test_reward_hacks.py keeps one such case, a known limit). In `separate` mode only the artifact paths travel,
but the verifier runs on them, so the same files inside an artifact (Harbor tasks often list the app's
directory) count as well. Grade untrusted policies in `separate` mode with artifacts that hold data rather
than code the verifier imports, or with the `command` evaluator (docs/security.md).

Whose fault: a verifier that times out, writes no reward file, or an unreadable one is the agent's (reward 0,
the reason in the details, as polar never guesses a reward). A runtime that is not a container, or one
without bash, or copies that fail, are not (raise: ERROR, masked).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import shlex
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar.evaluate.base import EvalContext, EvalResult
from polar.evaluate.support import SWEEP, EvaluatorError, StrictConfig, output_of, parse_config, tail
from polar.runtime.base import Runtime, RuntimeFailure

TESTS_DIR = "/tests"
VERIFIER_DIR = "/logs/verifier"
ARTIFACTS_DIR = "/logs/artifacts"
_FS_TIMEOUT_S = 120.0
log = logging.getLogger("polar.evaluate.harbor")
_warned: set[str] = set()


class TestFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1)
    mode: int = Field(0o644, ge=0, le=0o777)
    data: str  # base64


class HarborEvalConfig(StrictConfig):
    environment_mode: Literal["shared", "separate"] = "shared"
    timeout_seconds: float = Field(600.0, gt=0)  # [verifier] timeout_sec (Harbor's default)
    env: dict[str, str] = Field(default_factory=dict)
    artifacts: list[str | dict[str, Any]] = Field(default_factory=list)
    tests: list[TestFile] = Field(min_length=1)


def _artifact_paths(artifacts: list[str | dict[str, Any]]) -> list[str]:
    out = [ARTIFACTS_DIR]
    for a in artifacts:
        src = a if isinstance(a, str) else a.get("source") or a.get("path")
        if isinstance(src, str) and src.startswith("/") and src not in out:
            out.append(src)
    return out


def parse_reward(name: str, text: str) -> tuple[float | None, str, dict[str, Any]]:
    """(reward, reason, all rewards) from reward.json or reward.txt; reward None when it is unusable."""
    if not text.strip():
        return None, f"{name} is empty", {}
    if name == "reward.txt":
        try:
            value = float(text.strip())
        except ValueError:
            return None, f"reward.txt is not a number: {text.strip()[:100]!r}", {}
        return (value, "reward.txt", {"reward": value}) if math.isfinite(value) else (None, "not finite", {})
    try:
        data = json.loads(text)
    except ValueError:
        return None, "reward.json is not JSON", {}
    if not isinstance(data, dict):
        return None, "reward.json is not an object", {}
    rewards = {k: float(v) for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    if "reward" in rewards:
        return rewards["reward"], "reward.json", rewards
    if len(rewards) == 1:
        return next(iter(rewards.values())), "reward.json", rewards
    return None, f"reward.json has no 'reward' key (keys: {sorted(rewards)})", rewards


class HarborEvaluator:
    name = "harbor"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = parse_config(self.name, HarborEvalConfig, config)
        self.needs_fresh_runtime = self.config.environment_mode == "separate"
        if self.config.environment_mode == "shared" and "shared" not in _warned:
            _warned.add("shared")  # once per process: a dataset makes one evaluator per task
            log.warning(
                "harbor: environment_mode shared runs the verifier in the agent's container, among files the "
                "agent may have planted (a pytest.py, a replaced python3); for untrusted policies use separate "
                "(docs/security.md)"
            )

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        cfg = self.config
        backend = ctx.runtime.spec.backend
        if backend not in ("docker", "podman"):
            raise EvaluatorError(f"evaluator 'harbor' needs a docker or podman runtime, not {backend!r}")
        if cfg.environment_mode == "separate":
            if ctx.fresh is None:
                raise EvaluatorError("evaluator 'harbor' in separate mode needs a fresh runtime")
            target = ctx.fresh
            copied = await self._copy_artifacts(ctx.runtime, target)
        else:
            target = ctx.runtime
            await self._sh(target, SWEEP, "stopping the agent's processes", check=False)
            copied = []
        details: dict[str, Any] = {"environment_mode": cfg.environment_mode}
        if copied:
            details["artifacts"] = copied
        await self._sh(
            target,
            f"rm -rf {TESTS_DIR} {VERIFIER_DIR} && mkdir -p {TESTS_DIR} {VERIFIER_DIR} && chmod 777 {VERIFIER_DIR}",
            "preparing /tests and /logs/verifier",
        )
        await self._upload_tests(target)

        run = await target.exec(
            ["bash", f"{TESTS_DIR}/test.sh"], timeout_s=cfg.timeout_seconds, env=cfg.env or None
        )
        details |= {"exit_code": run.exit_code, "output": tail(output_of(run))}
        if run.timed_out:
            reason = f"the verifier timed out after {cfg.timeout_seconds:g} s"
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": reason})
        name, text = await self._reward_file(target)
        if name is None:
            reason = "the verifier wrote no /logs/verifier/reward.txt or reward.json"
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": reason})
        reward, source, rewards = parse_reward(name, text)
        if reward is None:
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": source})
        details |= {"rewards": rewards, "reason": f"{source}: {reward:g}"}
        return EvalResult(reward=reward, passed=reward >= 1.0, details=details)

    async def _sh(self, runtime: Runtime, script: str, what: str, *, check: bool = True) -> str:
        res = await runtime.exec(["bash", "-c", script], cwd="/", timeout_s=_FS_TIMEOUT_S)
        if res.exit_code in (126, 127) or (check and (res.exit_code != 0 or res.timed_out)):
            raise EvaluatorError(f"{what} failed (exit {res.exit_code}): {tail(res.stderr.strip(), 500)}")
        return res.stdout

    async def _upload_tests(self, runtime: Runtime) -> None:
        with tempfile.TemporaryDirectory(prefix="polar-harbor-") as tmp:
            root = Path(tmp) / "tests"
            for f in self.config.tests:
                path = (root / f.path).resolve()
                if not path.is_relative_to(root.resolve()):
                    raise EvaluatorError(f"evaluator.config.tests: {f.path!r} leaves the tests directory")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(base64.b64decode(f.data))
                path.chmod(f.mode)
            try:
                await runtime.upload(root, TESTS_DIR)
            except RuntimeFailure as exc:
                raise EvaluatorError(f"cannot copy the tests into the runtime: {exc}") from exc

    async def _copy_artifacts(self, agent: Runtime, fresh: Runtime) -> list[str]:
        """What Harbor hands a separate verifier: /logs/artifacts and the declared artifact paths, copied
        from the agent's container to the same place in the fresh one (a missing one is skipped)."""
        copied = []
        with tempfile.TemporaryDirectory(prefix="polar-harbor-") as tmp:
            for n, src in enumerate(_artifact_paths(self.config.artifacts)):
                quoted = shlex.quote(src)
                present = await agent.exec(
                    ["bash", "-c", f"test -e {quoted}"], cwd="/", timeout_s=_FS_TIMEOUT_S
                )
                if present.exit_code != 0:
                    continue
                local = Path(tmp) / str(n)
                try:
                    await agent.download(src, local)
                    parent = shlex.quote(str(Path(src).parent))
                    await self._sh(fresh, f"mkdir -p {parent} && rm -rf {quoted}", f"making room for {src}")
                    await fresh.upload(local, src)
                except RuntimeFailure as exc:
                    raise EvaluatorError(
                        f"cannot copy artifact {src} to the verifier's runtime: {exc}"
                    ) from exc
                copied.append(src)
        return copied

    async def _reward_file(self, runtime: Runtime) -> tuple[str | None, str]:
        """reward.json if the verifier wrote one, else reward.txt (Harbor's order), with its text."""
        for name in ("reward.json", "reward.txt"):
            path = shlex.quote(f"{VERIFIER_DIR}/{name}")
            res = await runtime.exec(
                ["bash", "-c", f"test -f {path} || exit 3; cat {path}"], cwd="/", timeout_s=_FS_TIMEOUT_S
            )
            if res.exit_code == 3:
                continue
            if res.exit_code != 0:
                raise EvaluatorError(f"cannot read {VERIFIER_DIR}/{name}: {tail(res.stderr.strip(), 500)}")
            return name, res.stdout
        return None, ""
