"""`harbor`: run a Harbor task's verifier (`tests/test.sh`) and read the reward it writes.

As Harbor does: the tests are copied to `/tests` after the agent finished, `bash /tests/test.sh` runs in the
workdir, and the reward is `/logs/verifier/reward.json`'s `reward` (when that file exists) or the number in
`/logs/verifier/reward.txt`; the script's exit code does not count. `environment_mode`:

- `shared` (Harbor's default): in the agent's own container. Before the tests go in, every process the agent
  left running is killed (a leftover could rewrite the reward file), and `/tests` and `/logs/verifier` are
  emptied (a `/logs` that is a symlink or a file is replaced), so nothing the agent wrote there (a doctored
  test.sh, a reward.txt of 1) counts: the tests come from the task, as read on the trainer's side.
- `separate`: in the fresh container the node prepared from the task's image, which gets, as in Harbor, only
  `/logs/artifacts` and the paths the task lists in `artifacts`, copied from the agent's container.

The verifier trusts whatever it runs, so before it runs, what the agent changed in the container against
its image (shared), or what its artifacts brought (separate), is reviewed (`review`, default on;
`polar.evaluate.container_review`): an import hook (`conftest.py`, `sitecustomize.py`, a `.pth`), a
runner configuration file where pytest looks for one, a module named like a standard-library or
test-framework module (`/app/pytest.py`), a change to the interpreter, its installed packages or the
system's commands is refused (reward 0, `details.refused`). The verifier then runs with the isolated Python
environment (`polar.evaluate.runner.ISOLATED_ENV`: no user site, no bytecode read or written, no inherited
`PYTHONPATH`/`PYTHONSTARTUP`/`PYTHONHOME`), no `BASH_ENV` or `ENV`, and a fresh empty HOME, unless the
task's `env` sets them. Not `PYTHONSAFEPATH`: a `python3 -m pytest` run from the workdir relies on it being
on `sys.path` (the review refuses the shadowing modules it would guard against).

Whose fault: a verifier that times out, writes no reward file, or an unreadable one is the agent's (reward 0,
the reason in the details, as polar never guesses a reward), and so is whatever the agent broke in its own
container that the evaluation needs (its `bash`, `/logs`, a full disk, a stopped container, artifacts that
cannot be copied): reward 0, never ERROR, which would mask the sample and spare the policy its 0. A runtime
that is not a container, an engine that does not answer, or a fresh container that fails, are not (raise:
ERROR, masked).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import secrets
import shlex
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar.evaluate.base import AgentFault, EvalContext, EvalResult
from polar.evaluate.container_review import review_container, system_changes
from polar.evaluate.review import CONFIG_FILES, Finding, refused
from polar.evaluate.runner import isolated_env
from polar.evaluate.support import (
    ENVIRONMENT_EXIT_CODES,
    SWEEP,
    EvaluatorError,
    StrictConfig,
    output_of,
    parse_config,
    tail,
)
from polar.runtime.base import Runtime, RuntimeFailure
from polar.runtime.container import ContainerRuntime, ListingTruncated

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
    # Review what the agent changed in the container (shared) or brought in its artifacts (separate) before
    # the verifier runs; false trusts it as Harbor does (a task whose own prepare changes the interpreter).
    review: bool = True
    # Runner configuration files the agent may not add or change where pytest looks for one.
    config_files: list[str] = Field(default_factory=lambda: list(CONFIG_FILES))


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


# Makes /tests, /logs/verifier (replacing a /logs that is a symlink or a file) and the verifier's HOME.
_PREPARE = r"""
if [ -L /logs ] || { [ -e /logs ] && [ ! -d /logs ]; }; then rm -f /logs || exit 1; fi
rm -rf /tests /logs/verifier && mkdir -p /tests /logs/verifier && chmod 777 /logs/verifier && mkdir -m 700 "$1"
"""


def verifier_env(runtime_env: Mapping[str, str], task_env: Mapping[str, str], home: str) -> dict[str, str]:
    """The verifier's variables: isolated Python, no shell start-up file, a fresh HOME; what the task's
    runtime or verifier sets wins."""
    base = {"BASH_ENV": "", "ENV": "", "HOME": home}
    return {k: v for k, v in base.items() if k not in runtime_env} | isolated_env(runtime_env, task_env)


class HarborEvaluator:
    name = "harbor"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = parse_config(self.name, HarborEvalConfig, config)
        self.needs_fresh_runtime = self.config.environment_mode == "separate"
        if not self.config.review and "unreviewed" not in _warned:
            _warned.add("unreviewed")  # once per process: a dataset makes one evaluator per task
            log.warning(
                "harbor: review is off: the verifier trusts what the agent changed in its container (a "
                "pytest.py, a replaced python3); keep it on for untrusted policies (docs/security.md)"
            )

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        cfg, agent = self.config, ctx.runtime
        if not isinstance(agent, ContainerRuntime) or agent.spec.backend not in ("docker", "podman"):
            raise EvaluatorError(
                f"evaluator 'harbor' needs a docker or podman runtime, not {agent.spec.backend!r}"
            )
        details: dict[str, Any] = {"environment_mode": cfg.environment_mode}
        shared = cfg.environment_mode == "shared"
        try:
            target = agent if shared else await self._separate(ctx, details)
            findings = await (
                self._shared(agent) if shared else self._review(target, details.get("artifacts", []))
            )
            if findings:
                return EvalResult(reward=0.0, passed=False, details=details | refused(findings))
            home = f"/tmp/polar-verifier-home-{secrets.token_hex(8)}"
            prepared = await target.exec(
                ["bash", "-c", _PREPARE, "polar", home], cwd="/", timeout_s=_FS_TIMEOUT_S
            )
            if prepared.exit_code != 0 or prepared.timed_out:
                what = f"preparing /tests and /logs/verifier (exit {prepared.exit_code}): {tail(prepared.stderr.strip(), 500)}"
                if shared and prepared.exit_code not in ENVIRONMENT_EXIT_CODES:
                    await _answers(agent)
                    raise AgentFault(f"{what} in the agent's container")
                raise EvaluatorError(what)
            await self._upload_tests(target, shared)
            env = verifier_env(target.spec.env, cfg.env, home)
            run = await target.exec(["bash", f"{TESTS_DIR}/test.sh"], timeout_s=cfg.timeout_seconds, env=env)
            details |= {"exit_code": run.exit_code, "output": tail(output_of(run))}
            if run.timed_out:
                reason = f"the verifier timed out after {cfg.timeout_seconds:g} s"
                return EvalResult(reward=0.0, passed=False, details={**details, "reason": reason})
            name, text = await self._reward_file(target)
        except AgentFault as fault:
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": str(fault)})
        if name is None:
            reason = "the verifier wrote no /logs/verifier/reward.txt or reward.json"
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": reason})
        reward, source, rewards = parse_reward(name, text)
        if reward is None:
            return EvalResult(reward=0.0, passed=False, details={**details, "reason": source})
        details |= {"rewards": rewards, "reason": f"{source}: {reward:g}"}
        return EvalResult(reward=reward, passed=reward >= 1.0, details=details)

    async def _shared(self, agent: ContainerRuntime) -> list[Finding]:
        """Kill what the agent left running, then review what it changed (a leftover could change more)."""
        swept = await agent.exec(["bash", "-c", SWEEP], cwd="/", timeout_s=_FS_TIMEOUT_S)
        broken = swept.exit_code in ENVIRONMENT_EXIT_CODES and not swept.timed_out
        if not self.config.review and not broken:
            return []
        changes = await _changes(agent)
        findings = await self._review(agent, None, changes) if self.config.review else []
        if broken and not findings:
            workdir = agent.runtime_path(agent.workdir)
            if changed := system_changes(changes, workdir):
                raise AgentFault(
                    f"the agent's container can no longer run bash (it changed {', '.join(changed[:5])})"
                )
            raise EvaluatorError(
                f"the container cannot run bash (exit {swept.exit_code}): {tail(swept.stderr, 500)}"
            )
        return findings

    async def _review(
        self, target: ContainerRuntime, within: list[str] | None, changes: list[tuple[str, str]] | None = None
    ) -> list[Finding]:
        if not self.config.review or within == []:
            return []
        if changes is None:
            changes = await _changes(target)
        workdir = target.runtime_path(target.workdir)
        # /tests and /logs/verifier are emptied and filled by the evaluator.
        skip = (TESTS_DIR, VERIFIER_DIR)
        return await review_container(target, changes, workdir, self.config.config_files, within, skip)

    async def _separate(self, ctx: EvalContext, details: dict[str, Any]) -> ContainerRuntime:
        if not isinstance(ctx.fresh, ContainerRuntime):
            raise EvaluatorError("evaluator 'harbor' in separate mode needs a fresh container runtime")
        assert isinstance(ctx.runtime, ContainerRuntime)
        copied = await self._copy_artifacts(ctx.runtime, ctx.fresh)
        if copied:
            details["artifacts"] = copied
        return ctx.fresh

    async def _sh(self, runtime: Runtime, script: str, what: str) -> str:
        res = await runtime.exec(["bash", "-c", script], cwd="/", timeout_s=_FS_TIMEOUT_S)
        if res.exit_code != 0 or res.timed_out:
            raise EvaluatorError(f"{what} failed (exit {res.exit_code}): {tail(res.stderr.strip(), 500)}")
        return res.stdout

    async def _upload_tests(self, runtime: ContainerRuntime, shared: bool) -> None:
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
                if shared:  # its container: a full disk, say
                    await _answers(runtime)
                    raise AgentFault(f"cannot copy the tests into the agent's container: {exc}") from exc
                raise EvaluatorError(f"cannot copy the tests into the runtime: {exc}") from exc

    async def _copy_artifacts(self, agent: ContainerRuntime, fresh: ContainerRuntime) -> list[str]:
        """What Harbor hands a separate verifier: /logs/artifacts and the declared artifact paths, copied
        from the agent's container to the same place in the fresh one (a missing one is skipped). What
        cannot be copied (a special file, a disk it fills) is the agent's doing, while the engines answer."""
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
                parent = shlex.quote(str(Path(src).parent))
                await self._sh(fresh, f"mkdir -p {parent} && rm -rf {quoted}", f"making room for {src}")
                try:
                    await agent.download(src, local)
                    await fresh.upload(local, src)
                except RuntimeFailure as exc:
                    await _answers(agent)
                    await _answers(fresh)
                    raise AgentFault(
                        f"cannot copy artifact {src} to the verifier's container: {exc}"
                    ) from exc
                copied.append(src)
        return copied

    async def _reward_file(self, runtime: Runtime) -> tuple[str | None, str]:
        """reward.json if the verifier wrote one, else reward.txt (Harbor's order), with its text. The
        verifier ran the agent's code: a file it cannot read is the agent's doing."""
        for name in ("reward.json", "reward.txt"):
            path = shlex.quote(f"{VERIFIER_DIR}/{name}")
            res = await runtime.exec(
                ["bash", "-c", f"test -f {path} || exit 3; cat {path}"], cwd="/", timeout_s=_FS_TIMEOUT_S
            )
            if res.exit_code == 3:
                continue
            if res.exit_code != 0:
                raise AgentFault(f"cannot read {VERIFIER_DIR}/{name}: {tail(res.stderr.strip(), 500)}")
            return name, res.stdout
        return None, ""


async def _changes(runtime: ContainerRuntime) -> list[tuple[str, str]]:
    try:
        return await runtime.changed_paths()
    except ListingTruncated as exc:
        raise AgentFault(f"the container changed more paths than can be reviewed: {exc}") from exc
    except RuntimeFailure as exc:
        raise EvaluatorError(f"cannot list what changed in the container: {exc}") from exc


async def _answers(runtime: ContainerRuntime) -> None:
    """Raise EvaluatorError unless the engine still answers for the container (a failure in it is then the
    container's own, not the engine's)."""
    try:
        await runtime.changed_paths()
    except ListingTruncated:
        pass
    except RuntimeFailure as exc:
        raise EvaluatorError(f"the container engine does not answer: {exc}") from exc
