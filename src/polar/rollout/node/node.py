"""The gateway node: admission, the staged pools, cancellation, results, and the HTTP server it runs.

    node = Node(NodeConfig(gateway=GatewayConfig(backend_url=...)))
    await node.start()                 # the gateway and the /node routes on one loopback port
    await node.submit(spec)            # admitted or refused (AdmissionError) at once
    result = await node.wait(spec.session_id)
    await node.drain()                 # or: finish what runs, hand back what did not start, leave
    await node.stop()                  # or: cancel what runs

Everything runs on the caller's event loop: the gateway serving the harnesses' calls, and one driver task per
session that takes a slot of each stage's pool in turn. Harnesses run as subprocesses, trajectories are built
in a worker thread, so the loop only coordinates.

What the node decides about a session id is written to its journal (`journal`, in the store file) before
anyone hears it: admitted, refused (a fence), ended with its result, handed back. So a restarted node on the
same store reports its predecessor's outcomes (and ERROR "node restarted" for what was running), never runs
an id twice, and answers a dispatch it already accepted, resent after a lost reply, with "already have it".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable

from polar.rollout.node.admission import AdmissionError, validate
from polar.rollout.node.app import create_node_app
from polar.rollout.node.config import NodeConfig
from polar.rollout.node.deadline import Deadline
from polar.rollout.node.gateway_link import NodeGateway
from polar.rollout.node.images import ImageInventory, node_engines
from polar.rollout.node.journal import Journal, State
from polar.rollout.node.lifecycle import (
    StageEnv,
    close_gateway_session,
    fresh_runtime,
    init_stage,
    post_stage,
    run_stage,
    session_metadata,
    stop_runtime,
)
from polar.rollout.node.metrics import NodeMetrics
from polar.rollout.node.models import GatewayModels
from polar.rollout.node.outcomes import Outcomes
from polar.rollout.node.pools import ReadyBuffer, StagePool
from polar.rollout.node.reporter import Reporter
from polar.rollout.node.servers import NodeServers
from polar.rollout.node.session import NodeSession, SessionEnd
from polar.rollout.protocol import (
    HeartbeatReply,
    NodeRegistration,
    NodeSessionState,
    NodeStatus,
    SessionResult,
    SessionSpec,
    SessionStatus,
)
from polar.rollout.rewards import SESSION_DEADLINE, assign_rewards
from polar.runtime import namespaces
from polar.runtime.base import Runtime
from polar.runtime.bridge import remove_stale_bridges
from polar.runtime.docker import reap_containers
from polar.runtime.leftovers import reap_leftovers, remove_dead_session_dirs

log = logging.getLogger("polar.node")


async def _reap_containers() -> None:
    for engine in ("docker", "podman"):
        await reap_containers(engine)


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.init_pool = StagePool("init", config.init_workers)
        self.ready = ReadyBuffer(config.ready_buffer)
        self.run_pool = StagePool("run", config.run_workers)
        self.post_pool = StagePool("post", config.post_workers)
        self._sessions: dict[str, NodeSession] = {}  # admitted, not finished
        self.draining = False
        self.reporter = Reporter(
            config.gateway.control_token,
            config.report_attempts,
            config.report_backoff_s,
            on_settled=self._settled,
        )
        self.outcomes = Outcomes(config, self.reporter)  # every id once it is not live: results, journal
        self.asgi = create_node_app(self)
        self.metrics = NodeMetrics(self.asgi.registry, self)  # beside the gateway's
        self.servers = NodeServers(self.asgi, config.gateway, config.gateway_workers)
        self.gateway: NodeGateway | None = None  # while started
        self._heartbeat: asyncio.Task[None] | None = None
        # Images only matter to a server placing sessions over several nodes.
        engines = node_engines(config.allowed_runtimes) if config.server_url and config.report_images else ()
        self.images = ImageInventory(engines)
        self._server_images: str | None = None  # the digest of our image list the server holds
        self._env: StageEnv | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._draining: asyncio.Task[None] | None = None

    # -- life of the node ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve the gateway's model API and the control listener, then register with the server (when
        there is one)."""
        gw = self.config.gateway
        # What a node killed with SIGKILL left (processes no PID namespace took along, gateway bridge
        # sockets, session directories, containers); and the namespace probe, once, off the loop (admission asks for it)
        await asyncio.to_thread(reap_leftovers)
        await asyncio.to_thread(remove_stale_bridges)
        await asyncio.to_thread(remove_dead_session_dirs, self.config.runtime_root)
        # Containers in the background: asking an engine takes a while, and none of them is in the way.
        self._reaper = asyncio.create_task(_reap_containers(), name="reap-containers")
        await asyncio.to_thread(namespaces.probe)
        interrupted = self.outcomes.open(gw.store_path, gw.durability)
        if interrupted:
            log.warning(
                "node %s: %d session(s) were running when the node stopped; they end ERROR (not run again)",
                self.node_id,
                len(interrupted),
            )
        self.gateway = await self.servers.start()
        self._env = StageEnv(
            gateway=self.gateway,
            store_path=gw.store_path,
            runtime_gateway_url=self.config.runtime_gateway_url,
            runtime_root=self.config.runtime_root,
            sandbox_paths=self.config.sandbox_paths,
            post_run_timeout_s=self.config.post_run_timeout_s,
            keep=self.config.keep,
            count_evaluation=self.metrics.evaluated,
            models=self.models(),
        )
        if self.config.server_url is not None:
            registration = NodeRegistration(
                node_id=self.node_id,
                url=self.config.advertise_url or self.servers.control.public_url,
                capacity=self.config.capacity,
            )
            self._heartbeat = asyncio.create_task(
                self.reporter.heartbeats(
                    self.config.server_url,
                    registration,
                    self.status,
                    self.config.heartbeat_s,
                    on_registered=self._report_owed,
                    on_reply=self._heard,
                )
            )
            await self.images.start()
        else:
            self.outcomes.report_owed(self._sessions)  # outcomes for sessions' own server_url, if any
        log.info(
            "node %s: model API at %s, control at %s (capacity %d)",
            self.node_id,
            self.url,
            self.control_url,
            self.config.capacity,
        )

    async def serve_forever(self) -> None:
        """Until `stop()` (e.g. from a signal handler) ends the HTTP servers, or the gateway's workers
        stop (their supervisor was killed)."""
        exited = await self.servers.wait()
        if exited is not None and not self._stopping:
            log.error("node %s: the gateway's workers exited (%s); stopping", self.node_id, exited)
        await self.stop()  # the server died on its own: still free every runtime

    def models(self) -> GatewayModels:
        """Frozen models for evaluators and group judging, through this node's gateway."""
        assert self.gateway is not None, "the node is not started"
        return GatewayModels(self.gateway, self.config.gateway.store_path)

    @property
    def journal(self) -> Journal | None:
        """The node's journal in the store file; open while the node is started."""
        return self.outcomes.journal

    @property
    def url(self) -> str:
        """The gateway's model API (what runtimes are pointed at); "" until started."""
        return self.servers.url

    @property
    def control_url(self) -> str:
        """/node/... and the gateway's control routes, token required; "" until started."""
        return self.servers.control_url

    async def stop(self, reason: str = "node stopped", *, report: bool = True) -> None:
        """Refuse new sessions, cancel running ones (they end CANCELLED with `reason`), stop serving.
        Idempotent: a second call (a signal during shutdown) waits for the first.

        `report=False`: results from now on are not sent to the server. For a local run that was
        interrupted, whose server keeps those sessions open so that resuming the run runs them again
        (`ServerStore.requeue_orphans`), rather than recording the interruption as their outcome."""
        if not report:
            self.outcomes.silent = True
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
        await self.images.aclose()
        await self.reporter.aclose()
        await self.servers.stop()
        await self.asgi.aclose()
        self._env = self.gateway = None  # the gateway's store is closed with it
        self.outcomes.close()

    # -- admission ----------------------------------------------------------------------------------------
    def _known(self, session_id: str) -> bool:
        """Whether this node (or its store) holds the id: admitted once, it is never admitted again."""
        return self.outcomes.seen(session_id) or self._in_store(session_id)

    def _in_store(self, session_id: str) -> bool:
        return self.gateway is not None and self.gateway.known(session_id)

    def _refuse(
        self, spec: SessionSpec, status: int, message: str, field: str | None = None
    ) -> AdmissionError:
        """A refusal is final for this dispatch: fenced first, so that a copy of it still in flight (a
        resend, a proxy's retry) can never be admitted after the server requeued the session."""
        self.outcomes.fence(spec.session_id, spec.result_token)
        return AdmissionError(status, message, field)

    async def submit(self, spec: SessionSpec) -> bool:
        """Admit `spec`: True when admitted now, False when this very dispatch (same `result_token`) was
        admitted before (a resend after a lost reply: nothing more happens). Raises `AdmissionError`: 409 seen
        before (or this dispatch was refused before), 429 full, 503 draining, 422 invalid."""
        sid, token = spec.session_id, spec.result_token
        if self._env is None or self.journal is None:
            raise AdmissionError(503, "the node is not started")
        entry = self.journal.get(sid)
        if entry is not None and entry.same_dispatch(token):
            if entry.state in (State.ADMITTED, State.ENDED, State.SETTLED):
                return False  # already have it
            raise AdmissionError(409, f"this dispatch of {sid} was refused or handed back earlier")
        if self._known(sid):
            raise AdmissionError(409, f"session {sid} was seen by this node; ids are single-use")
        if self.draining:
            raise self._refuse(spec, 503, "the node is draining and takes no new sessions")
        if len(self._sessions) >= self.config.capacity:
            raise self._refuse(spec, 429, f"the node is full ({self.config.capacity} sessions)")
        try:
            resolved = validate(spec, self.config)
        except AdmissionError as exc:
            raise self._refuse(spec, exc.status, exc.message, exc.field) from None
        harness, evaluator, fresh = resolved.harness, resolved.evaluator, resolved.fresh_runtime
        self.journal.admit(sid, token, spec.task.task_id, spec.server_url or self.config.server_url)
        deadline = Deadline(spec.task.timeout_seconds)
        s = NodeSession(spec=spec, harness=harness, evaluator=evaluator, deadline=deadline, wants_fresh=fresh)
        # Each stage change and each end is a heartbeat at once (coalesced): the server's and the dashboard's
        # counts per stage were a heartbeat behind ("running 2" with nothing running).
        s.on_stage = self.reporter.beat_now
        self._sessions[spec.session_id] = s
        s.driver = asyncio.create_task(self._drive(s), name=f"session-{spec.session_id}")
        s.driver.add_done_callback(lambda _: self._driver_ended(s))
        return True

    # -- queries ------------------------------------------------------------------------------------------
    def state(self, session_id: str) -> NodeSessionState | None:
        """What the node has of the session; None: it does not have it (never admitted, or handed back)."""
        s = self._sessions.get(session_id)
        if s is not None:
            return NodeSessionState(session_id=session_id, status=s.status)
        return self.outcomes.state(session_id, self._in_store)

    def probe(self, session_id: str, dispatch: str | None) -> NodeSessionState | None:
        """`state`, asked by the server about its dispatch `dispatch` (its result token). A "never had it" is
        fenced before it is answered: the server requeues the session on that answer, so that dispatch's
        request, if still in flight towards this node, must never be admitted after it."""
        state = self.state(session_id)
        if state is None:
            self.outcomes.fence(session_id, dispatch)
        return state

    def sessions(self) -> list[NodeSessionState]:
        live = [NodeSessionState(session_id=k, status=s.status) for k, s in self._sessions.items()]
        return live + self.outcomes.finished()

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
            workers={
                "init": self.config.init_workers,
                "run": self.config.run_workers,
                "post": self.config.post_workers,
                "ready_buffer": self.config.ready_buffer,
            },
            **self.images.report(self._server_images),
        )

    def _heard(self, reply: HeartbeatReply | None) -> None:
        """The server's answer to a heartbeat: which image list it holds, and what to fetch."""
        self._server_images = None if reply is None else reply.images_digest
        if reply is not None:
            self.images.want(reply.prefetch)

    async def wait(self, session_id: str) -> SessionResult:
        """The session's result once it is terminal (KeyError: not a session of this node)."""
        s = self._sessions.get(session_id)
        if s is not None:
            await s.done.wait()
        result = self.outcomes.result(session_id)
        if result is None:
            raise KeyError(session_id)
        return result

    async def cancel(self, session_id: str, reason: str = "cancelled by request") -> NodeSessionState | None:
        """Kill the session's process tree now and end it CANCELLED (no-op once terminal)."""
        s = self._sessions.get(session_id)
        if s is None:
            return self.state(session_id)
        if self._interrupt(s, reason):
            await self._kill(s)
        await s.done.wait()
        return self.state(session_id)

    @staticmethod
    def _interrupt(s: NodeSession, reason: str) -> bool:
        """Cancel the driver, synchronously: from here on the session cannot reach another stage. False when
        it was being cancelled already."""
        if s.cancel_reason is not None:
            return False
        s.cancel_reason = reason
        # The driver first, so that nothing the kill below makes fail (an evaluator's command, the agent's
        # exit) can finish the session as anything but CANCELLED.
        if s.driver is not None:
            s.driver.cancel()
        return True

    @staticmethod
    async def _kill(s: NodeSession) -> None:
        for runtime in (s.runtime, _done_runtime(s.fresh)):
            if runtime is not None:
                with contextlib.suppress(Exception):
                    await runtime.cancel()

    # -- drain --------------------------------------------------------------------------------------------
    def start_drain(self, reason: str = "node drained", timeout_s: float | None = None) -> asyncio.Task[None]:
        """Begin draining (idempotent: a second call joins the first); see `drain`."""
        if self._draining is None:
            self.draining = True  # refused from now on, and said so in the answer to whoever asked
            self._draining = asyncio.create_task(self._drain(reason, timeout_s), name="drain")
        return self._draining

    async def drain(self, reason: str = "node drained", timeout_s: float | None = None) -> None:
        """Leave gracefully: take no new session; hand every session whose agent has not started back to
        the server (its runtime stopped; the server runs it elsewhere, same id); let running ones finish and
        report (after `timeout_s`, if given, they are cancelled); then tell the server the node is gone and
        stop. Returns once the node has stopped."""
        await asyncio.shield(self.start_drain(reason, timeout_s))

    async def _drain(self, reason: str, timeout_s: float | None) -> None:
        self.draining = True
        self.reporter.beat_now()  # the server stops placing sessions here now, not a heartbeat later
        back = f"handed back unrun: {reason}"
        unstarted = [s for s in self._sessions.values() if SessionStatus.RUNNING.value not in s.marks]
        for s in unstarted:
            s.handed_back = back
        picked = [s for s in unstarted if self._interrupt(s, back)]  # all before any await
        log.info(
            "node %s draining (%s): %d session(s) handed back, %d left to finish",
            self.node_id,
            reason,
            len(picked),
            len(self._sessions) - len(picked),
        )
        await asyncio.gather(*(self._kill(s) for s in picked))
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(s.done.wait() for s in list(self._sessions.values())))
        except TimeoutError:
            why = f"{reason}: the drain's {timeout_s:g} s were up"
            await asyncio.gather(*(self.cancel(sid, why) for sid in list(self._sessions)))
        await self.reporter.flush()
        await self._leave()
        await self.stop(reason)

    async def _leave(self) -> None:
        """Deregister: the server agrees once it has every outcome of this node (409 until then)."""
        server = self.config.server_url
        if server is None:
            return
        if self._heartbeat is not None:  # a heartbeat after leaving would register the node again
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            self._heartbeat = None
        delay = self.config.report_backoff_s
        for _ in range(self.config.report_attempts):
            why = await self.reporter.leave(server, self.node_id)
            if why is None:
                log.info("node %s left %s", self.node_id, server)
                return
            log.info("node %s: the server is not ready to let it leave (%s)", self.node_id, why)
            self.outcomes.report_owed(self._sessions)
            await self.reporter.flush()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        log.warning(
            "node %s stops without the server's leave; outcomes it still owes stay in %s and are reported "
            "when a node starts on that store",
            self.node_id,
            self.config.gateway.store_path,
        )

    # -- one session --------------------------------------------------------------------------------------
    async def _within_deadline(self, s: NodeSession, what: str, wait: Awaitable[object]) -> None:
        try:
            async with asyncio.timeout(s.deadline.remaining()):
                await wait
        except TimeoutError:
            raise SessionEnd(SessionStatus.TIMEOUT, f"{SESSION_DEADLINE} while {what}") from None

    async def _prewarm(self, s: NodeSession) -> Runtime:
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
        if s.handed_back is not None and SessionStatus.RUNNING.value not in s.marks:
            self._hand_back(s, s.handed_back)
            return
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
        self.outcomes.ended(result, s.spec.server_url or self.config.server_url, s.spec.result_token)
        self._sessions.pop(s.session_id, None)
        self.reporter.beat_now()
        s.done.set()
        log.info("session %s %s%s", s.session_id, result.status.value, f": {s.reason}" if s.reason else "")

    def _hand_back(self, s: NodeSession, reason: str) -> None:
        """A session stopped before its agent ran (a drain): handed back to the server (`Outcomes`)."""
        server = s.spec.server_url or self.config.server_url
        self.outcomes.handed_back(s.session_id, s.spec.task.task_id, reason, server, s.spec.result_token)
        s.status = SessionStatus.REGISTERED
        self._sessions.pop(s.session_id, None)
        s.done.set()
        log.info("session %s handed back to the server: %s", s.session_id, reason)

    def _settled(self, session_id: str) -> None:
        self.outcomes.settled(session_id)

    async def _report_owed(self) -> None:
        """The reporter's `on_registered`: every outcome the server has not acknowledged, again."""
        self.outcomes.report_owed(self._sessions)


def _done_runtime(task: asyncio.Task[Runtime] | None) -> Runtime | None:
    if task is None or not task.done() or task.cancelled() or task.exception() is not None:
        return None
    return task.result()
