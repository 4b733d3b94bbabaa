"""The gateway node: admission, the staged pools, cancellation, results, and the HTTP server it runs.

    node = Node(NodeConfig(gateway=GatewayConfig(backend_url=...)))
    await node.start()                 # the gateway and the /node routes on one loopback port
    await node.submit(spec)            # admitted or refused (AdmissionError) at once
    result = await node.wait(spec.session_id)
    await node.stop()

Everything runs on the caller's event loop: the gateway serving the harnesses' calls, and one driver task per
session that takes a slot of each stage's pool in turn. Harnesses run as subprocesses, trajectories are built
in a worker thread, so the loop only coordinates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any

from polar.evaluate.registry import fresh_runtime_wanted, get_evaluator
from polar.harness.registry import get_harness
from polar.rollout.node.app import create_node_app
from polar.rollout.node.config import NodeConfig
from polar.rollout.node.deadline import Deadline
from polar.rollout.node.lifecycle import (
    StageEnv,
    close_gateway_session,
    fresh_runtime,
    init_stage,
    post_stage,
    run_stage,
    runtime_spec,
    session_metadata,
    stop_runtime,
)
from polar.rollout.node.metrics import NodeMetrics
from polar.rollout.node.pools import ReadyBuffer, StagePool
from polar.rollout.node.reporter import Reporter
from polar.rollout.node.session import NodeSession, SessionEnd
from polar.rollout.protocol import (
    NodeRegistration,
    NodeSessionState,
    NodeStatus,
    SessionResult,
    SessionSpec,
    SessionStatus,
)
from polar.rollout.rewards import SESSION_DEADLINE, assign_rewards
from polar.rollout.uploads import upload_violations
from polar.runtime import namespaces
from polar.runtime.bridge import remove_stale_bridges
from polar.runtime.docker import reap_containers
from polar.runtime.factory import check_runtime
from polar.runtime.leftovers import reap_leftovers
from polar.serving import EmbeddedServer, start_all, stop_all
from polar.trajectory import get_builder

log = logging.getLogger("polar.node")


async def _reap_containers() -> None:
    for engine in ("docker", "podman"):
        await reap_containers(engine)


class AdmissionError(Exception):
    """A session the node will not take: `status` is the HTTP status to answer, `field` what was wrong."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.init_pool = StagePool("init", config.init_workers)
        self.ready = ReadyBuffer(config.ready_buffer)
        self.run_pool = StagePool("run", config.run_workers)
        self.post_pool = StagePool("post", config.post_workers)
        self._sessions: dict[str, NodeSession] = {}  # admitted, not finished
        self._results: OrderedDict[str, SessionResult] = OrderedDict()  # finished, newest last
        self._archived: dict[str, SessionResult] = {}  # older finished ones, without their trajectory
        self._seen: set[str] = set()
        self.draining = False
        self.reporter = Reporter(
            config.gateway.control_token, config.report_attempts, config.report_backoff_s
        )
        self.asgi = create_node_app(self)
        self.metrics = NodeMetrics(self.asgi.gateway.state.metrics_registry, self)  # beside the gateway's
        gw = config.gateway
        self.data_server = EmbeddedServer(self.asgi.data, gw.host, gw.port)
        self.control_server = EmbeddedServer(
            self.asgi.control, gw.control_host, gw.control_port, lifespan="off", label="control port"
        )
        self._heartbeat: asyncio.Task[None] | None = None
        self._env: StageEnv | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._silent = False  # stop(report=False): finished sessions are not reported to the server
        self.url = ""  # the gateway's model API (what runtimes are pointed at)
        self.control_url = ""  # /node/... and the gateway's control routes, token required

    # -- life of the node ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve the gateway's model API and the control listener, then register with the server (when
        there is one)."""
        gw = self.config.gateway
        # What a node killed with SIGKILL left (processes no PID namespace took along, gateway bridge
        # sockets, containers); and the namespace probe, once, off the loop (admission asks for it)
        await asyncio.to_thread(reap_leftovers)
        await asyncio.to_thread(remove_stale_bridges)
        # Containers in the background: asking an engine takes a while, and none of them is in the way.
        self._reaper = asyncio.create_task(_reap_containers(), name="reap-containers")
        await asyncio.to_thread(namespaces.probe)
        await start_all([self.data_server, self.control_server])
        self.url = self.data_server.url
        self.control_url = self.control_server.url
        self._env = StageEnv(
            proxy=self.asgi.gateway.state.proxy,
            store_path=gw.store_path,
            gateway_url=self.config.runtime_gateway_url or self.url,
            runtime_root=self.config.runtime_root,
            post_run_timeout_s=self.config.post_run_timeout_s,
            keep=self.config.keep,
            count_evaluation=self.metrics.evaluated,
        )
        if self.config.server_url is not None:
            registration = NodeRegistration(
                node_id=self.node_id,
                url=self.config.advertise_url or self.control_server.public_url,
                capacity=self.config.capacity,
            )
            self._heartbeat = asyncio.create_task(
                self.reporter.heartbeats(
                    self.config.server_url, registration, self.status, self.config.heartbeat_s
                )
            )
        log.info(
            "node %s: model API at %s, control at %s (capacity %d)",
            self.node_id,
            self.url,
            self.control_url,
            self.config.capacity,
        )

    async def serve_forever(self) -> None:
        """Until `stop()` (e.g. from a signal handler) ends the HTTP servers."""
        await self.data_server.wait()
        await self.stop()  # the server died on its own: still free every runtime

    async def stop(self, reason: str = "node stopped", *, report: bool = True) -> None:
        """Refuse new sessions, cancel running ones (they end CANCELLED with `reason`), stop serving.
        Idempotent: a second call (a signal during shutdown) waits for the first.

        `report=False`: results from now on are not sent to the server. For a local run that was
        interrupted, whose server keeps those sessions open so that resuming the run runs them again
        (`ServerStore.requeue_orphans`), rather than recording the interruption as their outcome."""
        if not report:
            self._silent = True
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(reason))
        await asyncio.shield(self._stopping)

    async def _stop(self, reason: str) -> None:
        self.draining = True
        if self._reaper is not None:
            await asyncio.gather(self._reaper, return_exceptions=True)
        # Sessions first: they need the gateway's store to close their sessions.
        await asyncio.gather(*(self.cancel(sid, reason) for sid in list(self._sessions)))
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        await self.reporter.aclose()
        await stop_all([self.data_server, self.control_server])
        self._env = None  # the gateway's store is closed with it

    # -- admission ----------------------------------------------------------------------------------------
    def _validate(self, spec: SessionSpec) -> tuple[Any, Any, bool]:
        task = spec.task
        try:
            harness = get_harness(task.agent.harness, dict(task.agent.settings))
        except Exception as exc:
            raise AdmissionError(422, f"task.agent: {exc}", "task.agent.harness") from exc
        try:
            evaluator = get_evaluator(task.evaluator.strategy, dict(task.evaluator.config))
            fresh = fresh_runtime_wanted(evaluator, task.evaluator.fresh_runtime)
        except Exception as exc:
            raise AdmissionError(422, f"task.evaluator: {exc}", "task.evaluator.strategy") from exc
        try:
            get_builder(task.builder)
        except Exception as exc:
            raise AdmissionError(422, f"task.builder: {exc}", "task.builder") from exc
        try:
            check_runtime(runtime_spec(task, self.config.runtime_root))
        except Exception as exc:
            raise AdmissionError(422, f"task.runtime: {exc}", "task.runtime.backend") from exc
        for i, reason in upload_violations(task, self.config.upload_roots):
            field = f"task.runtime.prepare[{i}].src"
            raise AdmissionError(422, f"{field}: {reason}", field)
        return harness, evaluator, fresh

    def _known(self, session_id: str) -> bool:
        if session_id in self._seen:
            return True
        return self._env is not None and self._env.proxy.sessions.get(session_id) is not None

    async def submit(self, spec: SessionSpec) -> None:
        """Admit `spec` (raises `AdmissionError`: 409 seen before, 429 full, 503 draining, 422 invalid)."""
        if self.draining:
            raise AdmissionError(503, "the node is draining and takes no new sessions")
        if self._env is None:
            raise AdmissionError(503, "the node is not started")
        if self._known(spec.session_id):
            raise AdmissionError(409, f"session {spec.session_id} was seen by this node; ids are single-use")
        if len(self._sessions) >= self.config.capacity:
            raise AdmissionError(429, f"the node is full ({self.config.capacity} sessions)")
        harness, evaluator, fresh = self._validate(spec)
        self._seen.add(spec.session_id)
        deadline = Deadline(spec.task.timeout_seconds)
        s = NodeSession(spec=spec, harness=harness, evaluator=evaluator, deadline=deadline, wants_fresh=fresh)
        self._sessions[spec.session_id] = s
        s.driver = asyncio.create_task(self._drive(s), name=f"session-{spec.session_id}")
        s.driver.add_done_callback(lambda _: self._driver_ended(s))

    # -- queries ------------------------------------------------------------------------------------------
    def state(self, session_id: str) -> NodeSessionState | None:
        s = self._sessions.get(session_id)
        if s is not None:
            return NodeSessionState(session_id=session_id, status=s.status)
        result = self._result(session_id)
        if result is not None:
            return NodeSessionState(session_id=session_id, status=result.status, result=result)
        if self._known(session_id):
            # In this node's store but not in memory: a previous process ran it and died with it.
            lost = SessionResult(
                session_id=session_id,
                task_id="",
                node_id=self.node_id,
                status=SessionStatus.ERROR,
                reason="the node restarted while this session ran; its outcome was lost",
            )
            return NodeSessionState(session_id=session_id, status=lost.status, result=lost)
        return None

    def sessions(self) -> list[NodeSessionState]:
        live = [NodeSessionState(session_id=k, status=s.status) for k, s in self._sessions.items()]
        done = [
            NodeSessionState(session_id=k, status=r.status)
            for results in (self._archived, self._results)
            for k, r in results.items()
        ]
        return live + done

    def status(self) -> NodeStatus:
        by_stage: dict[str, int] = {}
        for s in self._sessions.values():
            by_stage[s.status.value] = by_stage.get(s.status.value, 0) + 1
        return NodeStatus(
            node_id=self.node_id,
            active=len(self._sessions),
            capacity=self.config.capacity,
            by_stage=by_stage,
            draining=self.draining,
        )

    async def wait(self, session_id: str) -> SessionResult:
        """The session's result once it is terminal (KeyError: not a session of this node)."""
        s = self._sessions.get(session_id)
        if s is not None:
            await s.done.wait()
        result = self._result(session_id)
        if result is None:
            raise KeyError(session_id)
        return result

    async def cancel(self, session_id: str, reason: str = "cancelled by request") -> NodeSessionState | None:
        """Kill the session's process tree now and end it CANCELLED (no-op once terminal)."""
        s = self._sessions.get(session_id)
        if s is None:
            return self.state(session_id)
        if s.cancel_reason is None:
            s.cancel_reason = reason
            # The driver first (synchronously), so that nothing the kill below makes fail (an evaluator's
            # command, the agent's exit) can finish the session as anything but CANCELLED.
            if s.driver is not None:
                s.driver.cancel()
            for runtime in (s.runtime, _done_runtime(s.fresh)):
                if runtime is not None:
                    with contextlib.suppress(Exception):
                        await runtime.cancel()
        await s.done.wait()
        return self.state(session_id)

    # -- one session --------------------------------------------------------------------------------------
    async def _within_deadline(self, s: NodeSession, what: str, wait: Any) -> None:
        try:
            async with asyncio.timeout(s.deadline.remaining()):
                await wait
        except TimeoutError:
            raise SessionEnd(SessionStatus.TIMEOUT, f"{SESSION_DEADLINE} while {what}") from None

    async def _prewarm(self, s: NodeSession) -> Any:
        assert self._env is not None
        async with self.init_pool.slot():
            return await fresh_runtime(s.spec.task, s.session_id, self._env)

    async def _stages(self, s: NodeSession) -> None:
        env = self._env
        assert env is not None
        async with self.init_pool.slot():
            await init_stage(s, env)
            # Holding the INIT worker while the buffer is full: INIT makes no runtime nobody can run yet.
            await self._within_deadline(s, "waiting for a place in the READY buffer", self.ready.acquire())
        s.enter(SessionStatus.READY)
        try:
            await self._within_deadline(s, "waiting READY for a run slot", self.run_pool.acquire())
        finally:
            self.ready.release()
        try:
            if s.wants_fresh:
                s.fresh = asyncio.create_task(self._prewarm(s))
            await run_stage(s, env)
        finally:
            self.run_pool.release()
        s.enter(SessionStatus.POST_RUN)  # waiting for a POSTRUN worker counts as POSTRUN, not as running
        async with self.post_pool.slot():
            trajectory = await post_stage(s, env)
        s.final = trajectory
        status = SessionStatus(trajectory.status.value)
        if status != s.outcome:  # rewards refused the evaluation: the session is an ERROR after all
            s.outcome, s.reason = status, trajectory.metadata.get("reward_reason", s.reason)

    async def _drive(self, s: NodeSession) -> None:
        try:
            await self._stages(s)
        except SessionEnd as end:
            s.outcome, s.reason = end.status, end.reason
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            s.outcome = SessionStatus.CANCELLED
            s.reason = s.cancel_reason or "cancelled: the node's event loop is shutting down"
        except Exception as exc:  # a bug in the node or a contract broken by a plugin: never lose the session
            log.exception("session %s failed in the node", s.session_id)
            s.outcome, s.reason = SessionStatus.ERROR, f"node error: {type(exc).__name__}: {exc}"
        finally:
            await self._teardown(s)
            self._finish(s)

    def _driver_ended(self, s: NodeSession) -> None:
        """A driver cancelled before its first step never enters `_drive` (asyncio drops the coroutine
        unstarted), so its `finally` never finishes the session: `cancel` right after `submit` would
        wait on `s.done` forever and the session would hold its slot. Finish it here; nothing of it
        started, so there is nothing to tear down. (A second cancel during teardown ends up here too.)"""
        if s.done.is_set():
            return
        if not s.marks:  # never reached a stage
            s.outcome = SessionStatus.CANCELLED
            s.reason = s.cancel_reason or "cancelled: the node's event loop is shutting down"
        else:
            log.error("session %s: its driver was stopped during teardown", s.session_id)
        self._finish(s)

    async def _teardown(self, s: NodeSession) -> None:
        if s.fresh is not None:
            if not s.fresh.done():
                s.fresh.cancel()
            await asyncio.gather(s.fresh, return_exceptions=True)
            fresh = _done_runtime(s.fresh)
            if fresh is not None:
                await stop_runtime(fresh)
        if s.runtime is not None:
            await stop_runtime(s.runtime)
        if self._env is not None:
            await close_gateway_session(s, self._env)

    def _finish(self, s: NodeSession) -> None:
        trajectory = s.final
        if trajectory is None and s.trajectory is not None:
            # Built, then the session failed (evaluator, cancel): kept for inspection, fully masked.
            trajectory = assign_rewards(s.trajectory, s.outcome.value, None, reason=s.reason)
        reward = None
        if trajectory is not None and not trajectory.metadata.get("masked", False):
            reward = trajectory.metadata.get("reward")
        result = SessionResult(
            session_id=s.session_id,
            task_id=s.spec.task.task_id,
            node_id=self.node_id,
            status=s.outcome,
            reason=s.reason,
            reward=reward,
            trajectory=trajectory.model_dump(mode="json") if trajectory is not None else None,
            timings=s.timings(time.monotonic()),
            metadata={**session_metadata(s), **s.metadata},
        )
        s.status = s.outcome
        s.result = result
        self.metrics.ended(s.outcome)
        self._results[s.session_id] = result
        self._sessions.pop(s.session_id, None)
        self._trim()
        s.done.set()
        log.info("session %s %s%s", s.session_id, result.status.value, f": {s.reason}" if s.reason else "")
        server = s.spec.server_url or self.config.server_url
        if server is not None and not self._silent:
            self.reporter.report(server, result, s.spec.result_token)

    def _trim(self) -> None:
        """Old results keep their status and reason but drop the trajectory (memory stays bounded)."""
        while len(self._results) > self.config.keep_results:
            sid, old = self._results.popitem(last=False)
            self._archived[sid] = old.model_copy(update={"trajectory": None})

    def _result(self, session_id: str) -> SessionResult | None:
        return self._results.get(session_id) or self._archived.get(session_id)


def _done_runtime(task: asyncio.Task[Any] | None) -> Any:
    if task is None or not task.done() or task.cancelled() or task.exception() is not None:
        return None
    return task.result()
