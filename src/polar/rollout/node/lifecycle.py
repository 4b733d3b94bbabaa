"""The stages of one session, without the pools: INIT, RUNNING and POSTRUN bodies.

Each stage either advances the `NodeSession` or raises `SessionEnd` with a terminal status and a reason.
The node (`polar.rollout.node.node`) decides when a stage may run (its pools) and always tears down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tenacity import retry_if_exception_type

from polar.evaluate.base import AgentFault, EvalContext, EvalResult, EvaluatorModels
from polar.harness.base import HarnessContext
from polar.harness.extensions import check_commands
from polar.harness.install import tools_home
from polar.harness.registry import runs_from_tool_cache
from polar.retry import retrying
from polar.rollout.node.deadline import Deadline, RunLimit
from polar.rollout.node.gateway_link import NodeGateway
from polar.rollout.node.session import NodeSession, SessionEnd
from polar.rollout.node.side_calls import apply_policy, gateway_route
from polar.rollout.protocol import SessionStatus
from polar.rollout.rewards import AGENT_BUDGET_EXHAUSTED, SESSION_DEADLINE, assign_rewards
from polar.runtime.base import ExecResult, Runtime, RuntimeFailure, RuntimeSpec
from polar.runtime.factory import IMAGE_BACKENDS, default_backend, make_runtime
from polar.runtime.leftovers import claim_session_dir, release_session_dir
from polar.runtime.local import Keep
from polar.store.records import CompletionRecord
from polar.store.sqlite import SQLiteStore
from polar.task import ExecAction, Task, UploadAction
from polar.trajectory import Trajectory, TrajectoryStatus, build
from polar.trajectory.retries import DEAD_BRANCH, tag_retries

ERROR, TIMEOUT = SessionStatus.ERROR, SessionStatus.TIMEOUT
_GRACE_S = 10.0  # past a runtime's own exec timeout before the node stops waiting for it


# What `evaluate` tells its counter (polar_node_evaluations_total{outcome}): a verdict, a reward without
# one (scored), or no verdict at all.
EVAL_OUTCOMES = ("passed", "failed", "scored", "error", "timeout")


def _uncounted(outcome: str) -> None:
    pass


@dataclass(frozen=True)
class StageEnv:
    """What the stages need from the node."""

    gateway: NodeGateway
    store_path: Path
    runtime_gateway_url: str | None  # the gateway as runtimes reach it, when not as this machine does
    runtime_root: Path | None
    post_run_timeout_s: float
    sandbox_paths: tuple[Path, ...] = ()  # read-only in every sandbox (NodeConfig.sandbox_paths)
    keep: Keep = "nothing"  # what of the agent's session directory survives teardown (logs, transcripts)
    count_evaluation: Callable[[str], None] = _uncounted  # the node's metrics (`evaluate`)
    models: EvaluatorModels | None = None  # frozen models for evaluators, through this gateway (a judge)

    def gateway_url_for(self, session_id: str) -> str:
        """The model API a session's runtime is pointed at: the node's address for runtimes when it names
        one, else the gateway process that serves the session (`NodeGateway.url_for`)."""
        return self.runtime_gateway_url or self.gateway.url_for(session_id)


def _tail(text: str, n: int = 400) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def runtime_spec(task: Task, root: Path | None, shared: tuple[Path, ...] = ()) -> RuntimeSpec:
    """The runtime a session of `task` gets here; a task that names none gets the node's strongest
    (`default_backend`, which raises `RuntimeFailure` where there is none). `shared`: the node's own
    read-only paths for every sandbox."""
    rt = task.runtime
    backend = rt.backend or default_backend()
    mounts: tuple[str, ...] = (*rt.read_only_paths, *map(str, shared))
    if backend in IMAGE_BACKENDS and runs_from_tool_cache(task.agent.harness):
        # The CLI presets install their pinned program into the node's tool cache during setup, after the
        # container started (READY buffer): the whole cache is mounted read-only at its host path, so the
        # installed binary shows up inside at the path the preset runs it by. (bwrap shows the cache to
        # every sandbox: `polar.runtime.sandbox.visible_paths`.)
        cache = tools_home()
        cache.mkdir(parents=True, exist_ok=True)
        mounts = (*mounts, str(cache))
    return RuntimeSpec(
        backend=backend,
        image=rt.image,
        workdir=rt.workdir,
        env=dict(rt.env),
        network=rt.network,
        root=root,
        cpus=rt.cpus,
        memory_mb=rt.memory_mb,
        pids_limit=rt.pids_limit,
        read_only_paths=mounts,
    )


# -- INIT -------------------------------------------------------------------------------------------------
class _StepFailed(Exception):
    """One attempt of a prepare command failed (an error, a non-zero exit, a timeout): maybe transiently."""


async def _exec_with_retries(runtime: Runtime, step: int, action: ExecAction, deadline: Deadline) -> None:
    """Run a prepare command, `action.retries` more times on failure (0.2 s doubling to 2 s between)."""

    async def attempt() -> None:
        try:
            result = await runtime.exec(
                action.cmd, timeout_s=min(action.timeout_seconds, deadline.remaining())
            )
        except Exception as exc:  # RuntimeFailure and friends: the step failed, maybe transiently
            raise _StepFailed(_describe(exc)) from exc
        if result.exit_code != 0 or result.timed_out:
            how = "timed out" if result.timed_out else f"exit code {result.exit_code}"
            raise _StepFailed(f"{how}: {_tail(result.stderr or result.stdout)}")

    attempts = action.retries + 1
    policy = retrying(attempts=attempts, first_s=0.2, cap_s=2.0, retry=retry_if_exception_type(_StepFailed))
    try:
        await policy(attempt)
    except _StepFailed as last:
        raise SessionEnd(
            ERROR, f"prepare step {step} ({action.cmd!r}) failed after {attempts} attempt(s): {last}"
        ) from None


async def prepare(runtime: Runtime, task: Task, deadline: Deadline) -> None:
    """Run the task's prepare actions in order: uploads, then commands retried on a non-zero exit."""
    for step, action in enumerate(task.runtime.prepare):
        if isinstance(action, UploadAction):
            try:
                await runtime.upload(Path(action.src), action.dst)
            except Exception as exc:
                raise SessionEnd(
                    ERROR, f"prepare step {step}: upload {action.src}: {_describe(exc)}"
                ) from exc
        else:
            await _exec_with_retries(runtime, step, action, deadline)


async def start_runtime(
    task: Task, session_id: str, env: StageEnv, deadline: Deadline, keep: Keep = "nothing"
) -> Runtime:
    """A started and prepared runtime for `task`; stopped again if anything fails (or is cancelled)."""
    try:
        spec = runtime_spec(task, env.runtime_root, env.sandbox_paths)
        runtime = make_runtime(spec, session_id, gateway_url=env.gateway_url_for(session_id), keep=keep)
    except Exception as exc:
        raise SessionEnd(ERROR, f"runtime failed to start: {_describe(exc)}") from exc
    if keep == "nothing":  # a node killed before `stop_runtime` leaves it: the next start removes it
        claim_session_dir(runtime.session_dir)
    try:
        try:
            await runtime.start()
        except Exception as exc:
            raise SessionEnd(ERROR, f"runtime failed to start: {_describe(exc)}") from exc
        await prepare(runtime, task, deadline)
    except BaseException:
        await stop_runtime(runtime)
        raise
    return runtime


async def stop_runtime(runtime: Runtime) -> None:
    """Kill what still runs and free the runtime; never raises (teardown must not block other sessions)."""
    for op in (runtime.cancel, runtime.stop):
        try:
            await asyncio.wait_for(op(), timeout=60)
        except Exception:  # each step is tried even when the one before failed
            continue
    release_session_dir(runtime.session_dir)


def _context(s: NodeSession, runtime: Runtime, env: StageEnv) -> HarnessContext:
    task = s.spec.task
    home = runtime.runtime_path(runtime.home)
    artifacts = runtime.runtime_path(runtime.artifacts)
    gateway = runtime.gateway_url or env.gateway_url_for(s.session_id)
    return HarnessContext(
        session_id=s.session_id,
        gateway_url=str(gateway).rstrip("/"),
        model=task.agent.model or env.gateway.served_model,
        instruction=task.instruction,
        home=home,
        workdir=runtime.runtime_path(runtime.workdir),
        artifacts=artifacts,
        settings=dict(task.agent.settings),
        env=dict(task.agent.env),
        mcp_servers=dict(task.agent.mcp_servers),
        skills=list(task.agent.skills),
    )


def session_metadata(s: NodeSession) -> dict[str, Any]:
    """Carried on the gateway session, the trajectory and the result: task metadata, group and sample."""
    spec = s.spec
    return {
        **spec.task.metadata,
        "task_id": spec.task.task_id,
        "group_id": spec.group_id or spec.task.metadata.get("group_id") or spec.task.task_id,
        "sample_index": spec.sample_index,
    }


async def init_stage(s: NodeSession, env: StageEnv) -> None:
    """Runtime, prepare actions, the gateway session and the harness's setup, within the session deadline."""
    s.enter(SessionStatus.INITIALIZING)
    s.deadline.start()
    try:
        async with asyncio.timeout(s.deadline.remaining()):
            s.runtime = await start_runtime(s.spec.task, s.session_id, env, s.deadline, env.keep)
            try:
                # The side-call route travels only to the gateway (it is not trajectory metadata).
                metadata = {**session_metadata(s), **gateway_route(s.spec.task.agent)}
                await env.gateway.open(metadata, s.session_id)
            except KeyError:
                raise SessionEnd(
                    ERROR, "the gateway store already holds this session id (ids are single-use)"
                ) from None
            except ValueError as exc:  # a side-call route the gateway cannot build
                raise SessionEnd(ERROR, f"gateway session: {exc}") from None
            s.gateway_open = True
            s.ctx = _context(s, s.runtime, env)
            try:
                await s.harness.setup(s.runtime, s.ctx)
            except Exception as exc:
                raise SessionEnd(ERROR, f"harness setup failed: {_describe(exc)}") from exc
            if s.ctx.mcp_servers:
                await _check_mcp_commands(s, s.runtime, s.ctx)
    except TimeoutError:
        raise SessionEnd(TIMEOUT, f"{SESSION_DEADLINE} during INIT") from None


async def _check_mcp_commands(s: NodeSession, runtime: Runtime, ctx: HarnessContext) -> None:
    """The session ends now, naming the server, when the runtime lacks a program the task's MCP servers
    name (`polar.harness.extensions.check_commands`: some harnesses wait for it until the deadline)."""
    try:
        env = s.harness.env(ctx)
    except Exception:  # said when the harness is launched ("harness gave no command")
        return
    try:
        await check_commands(runtime, ctx.mcp_servers, env)
    except RuntimeFailure as exc:
        raise SessionEnd(ERROR, str(exc)) from None


async def fresh_runtime(task: Task, session_id: str, env: StageEnv) -> Runtime:
    """The evaluator's clean runtime, made from the task like the agent's (prepared while the agent runs)."""
    deadline = Deadline(task.evaluation_timeout())
    deadline.start()
    async with asyncio.timeout(deadline.remaining()):
        return await start_runtime(task, session_id, env, deadline)


# -- RUNNING ----------------------------------------------------------------------------------------------
async def run_stage(s: NodeSession, env: StageEnv) -> None:
    """Run the harness's command until it exits or its time (agent budget or deadline) is up."""
    assert s.runtime is not None and s.ctx is not None
    s.enter(SessionStatus.RUNNING)
    limit = RunLimit.of(s.deadline, s.spec.task.agent.budget_seconds)
    if limit.seconds <= 0:
        raise SessionEnd(TIMEOUT, f"{SESSION_DEADLINE} before the agent started")
    try:
        command, run_env = s.harness.command(s.ctx), s.harness.env(s.ctx)
    except Exception as exc:
        raise SessionEnd(ERROR, f"harness gave no command: {_describe(exc)}") from exc
    started = time.monotonic()
    try:
        async with asyncio.timeout(limit.seconds + _GRACE_S):
            result = await s.runtime.exec(command, timeout_s=limit.seconds, env=run_env)
    except TimeoutError:
        # The runtime did not enforce its own timeout: kill the tree ourselves.
        await s.runtime.cancel()
        result = ExecResult(124, "", "", timed_out=True, duration_s=time.monotonic() - started)
    except Exception as exc:
        raise SessionEnd(ERROR, f"harness could not run: {_describe(exc)}") from exc
    s.agent = result
    if result.timed_out:
        s.outcome = TIMEOUT
        s.reason = (
            f"{AGENT_BUDGET_EXHAUSTED} ({limit.seconds:g} s)"
            if limit.by_budget
            else f"{SESSION_DEADLINE} ({s.deadline.timeout_s:g} s) while the agent ran"
        )
    elif result.exit_code < 0:
        raise SessionEnd(ERROR, f"harness killed by signal {-result.exit_code}: {_tail(result.stderr)}")
    elif result.exit_code in (126, 127):  # the shell could not run the command at all
        raise SessionEnd(
            ERROR, f"harness command failed to start ({result.exit_code}): {_tail(result.stderr)}"
        )
    elif result.exit_code != 0:
        failure = await asyncio.to_thread(_backend_failure, env.store_path, s.session_id)
        if failure is not None:
            # The agent failed because the policy's server did: an infrastructure error, fully masked, never
            # a zero-reward sample to learn from.
            raise SessionEnd(ERROR, f"inference backend failed during the run ({failure})")
        # The agent's own outcome (gave up, turn limit): evaluated like any other; the evaluator decides.
        s.reason = f"harness exited with code {result.exit_code}"


# Gateway failure kinds that are the inference server's fault, not the policy's (a context-length or
# invalid-request error is the policy's own doing and stays an agent outcome). `not_found` is the server's
# 404, the gateway always sending the model it serves: that model is gone there (a LoRA adapter unloaded
# after a sync, a server restarted with another model), which no sample of the policy's caused.
_INFRA_FAILURES = frozenset({"upstream_error", "timeout", "overloaded", "rate_limit", "not_found"})


def _backend_failure(store_path: Path, session_id: str) -> str | None:
    """The last infrastructure failure the gateway recorded for this session, if any."""
    with SQLiteStore(store_path) as store:
        failures = [f for f in store.failures(session_id) if f.kind in _INFRA_FAILURES]
    if not failures:
        return None
    last = failures[-1]
    return f"{len(failures)} failed call(s), last: {last.status} {last.kind}: {last.message}"


# -- POSTRUN ----------------------------------------------------------------------------------------------
def _records(path: Path, session_id: str) -> list[CompletionRecord]:
    with SQLiteStore(path) as store:
        return store.completions(session_id)


def _classified(s: NodeSession, records: list[CompletionRecord]) -> list[CompletionRecord]:
    """Records with the harness's tags added (side calls: title generation, a small model), which builders
    and trainers read from `CompletionRecord.tags`."""
    out = []
    for r in records:
        try:
            tags = tuple(s.harness.classify(r))
        except Exception as exc:
            raise SessionEnd(ERROR, f"harness classify failed: {_describe(exc)}") from exc
        out.append(replace(r, tags=tuple(dict.fromkeys((*r.tags, *tags)))) if tags else r)
    return out


async def close_gateway_session(s: NodeSession, env: StageEnv) -> None:
    """Refuse further calls under this session's key (a stray process cannot add to a finished run)."""
    if s.gateway_open:
        s.gateway_open = False
        try:
            await env.gateway.close(s.session_id)
        except Exception:  # the store write failed; the trajectory reads what was committed
            pass


async def build_trajectory(s: NodeSession, env: StageEnv) -> Trajectory:
    """The session's trajectory from the gateway's records, with the task's builder (no traces when the
    harness made no call; a TIMEOUT keeps what was captured: a partial trajectory)."""
    s.enter(SessionStatus.BUILDING)
    await close_gateway_session(s, env)
    task = s.spec.task
    records = _classified(s, await asyncio.to_thread(_records, env.store_path, s.session_id))
    records, side_calls = apply_policy(records, task.agent.side_calls)
    records = tag_retries(records)  # what `builder_options.dead_branches` masks or drops
    status = TrajectoryStatus.TIMEOUT if s.outcome == TIMEOUT else TrajectoryStatus.COMPLETED
    try:
        trajectory = await asyncio.to_thread(
            build, records, task.builder, status=status, **task.builder_options
        )
    except Exception as exc:
        raise SessionEnd(ERROR, f"trajectory builder {task.builder!r} failed: {_describe(exc)}") from exc
    meta = {
        **trajectory.metadata,
        **session_metadata(s),
        "session_id": s.session_id,
        "side_calls": side_calls,
        "dead_branches": [r.completion_id for r in records if DEAD_BRANCH in r.tags],
    }
    return trajectory.model_copy(update={"metadata": meta})


async def evaluate(
    s: NodeSession,
    trajectory: Trajectory,
    count: Callable[[str], None] = _uncounted,
    models: EvaluatorModels | None = None,
) -> EvalResult:
    """The evaluator's verdict within the task's evaluator timeout (which includes waiting for its
    fresh runtime, normally ready long before). `count` is told the outcome (`EVAL_OUTCOMES`; a cancelled
    evaluation has none)."""
    s.enter(SessionStatus.EVALUATING)
    timeout = s.spec.task.evaluation_timeout()
    try:
        async with asyncio.timeout(timeout):
            result = await _judge(s, trajectory, models)
    except TimeoutError:
        count("timeout")
        raise SessionEnd(ERROR, f"evaluator timed out after {timeout:g} s") from None
    except SessionEnd:
        count("error")
        raise
    count("scored" if result.passed is None else "passed" if result.passed else "failed")
    return result


async def _judge(s: NodeSession, trajectory: Trajectory, models: EvaluatorModels | None) -> EvalResult:
    assert s.runtime is not None
    fresh = None
    if s.fresh is not None:
        try:
            fresh = await asyncio.shield(s.fresh)
        except SessionEnd as end:
            raise SessionEnd(ERROR, f"evaluator runtime: {end.reason}") from None
        except Exception as exc:
            raise SessionEnd(ERROR, f"evaluator runtime failed: {_describe(exc)}") from exc
    ctx = EvalContext(
        task=s.spec.task,
        session_id=s.session_id,
        runtime=s.runtime,
        fresh=fresh,
        agent=s.agent,
        trajectory=trajectory,
        config=dict(s.spec.task.evaluator.config),
        models=models,
    )
    try:
        return await s.evaluator.evaluate(ctx)
    except AgentFault as fault:
        return EvalResult(reward=0.0, passed=False, details={"reason": str(fault)})
    except (SessionEnd, TimeoutError):
        raise
    except Exception as exc:
        raise SessionEnd(ERROR, f"evaluator failed: {_describe(exc)}") from exc


async def post_stage(s: NodeSession, env: StageEnv) -> Trajectory:
    """Post-run hook, trajectory, evaluation (COMPLETED runs only) and fail-closed rewards."""
    assert s.runtime is not None and s.ctx is not None
    s.enter(SessionStatus.POST_RUN)
    try:
        async with asyncio.timeout(env.post_run_timeout_s):
            s.metadata["harness"] = await s.harness.post_run(s.runtime, s.ctx)
    except TimeoutError:
        raise SessionEnd(
            ERROR, f"harness post-run hook timed out after {env.post_run_timeout_s:g} s"
        ) from None
    except Exception as exc:
        raise SessionEnd(ERROR, f"harness post-run hook failed: {_describe(exc)}") from exc
    trajectory = await build_trajectory(s, env)
    s.trajectory = trajectory
    completed = s.outcome == SessionStatus.COMPLETED
    result = await evaluate(s, trajectory, env.count_evaluation, env.models) if completed else None
    if result is not None:
        s.metadata["evaluation"] = {"passed": result.passed, "details": result.details}
    return assign_rewards(trajectory, s.outcome.value, result, reason=s.reason)
