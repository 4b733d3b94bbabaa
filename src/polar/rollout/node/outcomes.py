"""What a node has decided about each session id once it left the node's hands, and who has heard it.

A finished session's result (the newest `keep_results` whole, older ones without their trajectory), a
session handed back unrun (a drain), and the journal behind both: each decision is written to the journal
before anyone hears of it, then reported to the session's server until it acknowledges (`Reporter`). A
restarted node on the same store answers for its predecessor's ids from the journal alone.

The node keeps its live sessions; this object answers for every id that is not live any more.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Container
from pathlib import Path

from polar.rollout.node.config import NodeConfig
from polar.rollout.node.journal import Entry, Journal, State
from polar.rollout.node.reporter import Reporter
from polar.rollout.protocol import NodeSessionState, SessionResult, SessionStatus
from polar.store.sqlite import Durability

log = logging.getLogger("polar.node")


class Outcomes:
    def __init__(self, config: NodeConfig, reporter: Reporter) -> None:
        self.node_id = config.node_id
        self.server_url = config.server_url  # the node's own server, if it registers with one
        self.keep_results = config.keep_results
        self.tombstone_ttl_s = config.tombstone_ttl_s
        self.reporter = reporter  # the node's: it also sends the heartbeats
        self.journal: Journal | None = None  # open while the node is started
        self.silent = False  # the node stopped with report=False: outcomes from now on are not reported
        self._results: OrderedDict[str, SessionResult] = OrderedDict()  # finished, newest last
        self._archived: dict[str, SessionResult] = {}  # older finished ones, without their trajectory
        self._returned: set[str] = set()  # handed back to the server unrun (a drain)
        self._pruned_at = 0.0

    # -- the journal --------------------------------------------------------------------------------------
    def open(self, store_path: Path, durability: Durability) -> list[Entry]:
        """Open the journal in the store file; returns what a previous process left running (ended ERROR
        now, never run again)."""
        self.journal = Journal(store_path, durability)
        interrupted = self.journal.interrupted(self.node_id)
        self.journal.prune(self.tombstone_ttl_s)
        return interrupted

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None

    def seen(self, session_id: str) -> bool:
        """Whether the journal holds the id (a fence, written for a refused dispatch, does not count)."""
        entry = self.journal.get(session_id) if self.journal is not None else None
        return entry is not None and entry.state is not State.FENCED

    def fence(self, session_id: str, dispatch: str | None) -> None:
        """That dispatch of the id is never admitted from now on (refused, or answered "never had it")."""
        if dispatch is not None and self.journal is not None:
            self.journal.fence(session_id, dispatch)

    def settled(self, session_id: str) -> None:
        """The server acknowledged the outcome (the reporter's callback)."""
        if self.journal is not None:
            self.journal.settle(session_id)

    # -- what ended ---------------------------------------------------------------------------------------
    def ended(self, result: SessionResult, server: str | None, dispatch: str | None) -> None:
        """A session finished: on disk first, then kept here, then reported to `server`."""
        report = server is not None and not self.silent
        if self.journal is not None:
            self.journal.end(result, owed=report)
        self._results[result.session_id] = result
        while len(self._results) > self.keep_results:  # old results drop their trajectory: memory bounded
            sid, old = self._results.popitem(last=False)
            self._archived[sid] = old.model_copy(update={"trajectory": None})
        if report:
            assert server is not None
            self.reporter.report(server, result, dispatch)
        now = time.monotonic()
        if self.journal is not None and now - self._pruned_at > 60.0:  # tombstones, at most once a minute
            self._pruned_at = now
            self.journal.prune(self.tombstone_ttl_s)

    def handed_back(
        self, session_id: str, task_id: str, reason: str, server: str | None, dispatch: str | None
    ) -> None:
        """A session stopped before its agent ran (a drain): the server gets it back to run elsewhere, as a
        report with status REGISTERED, and this node answers "not here" for it from now on."""
        report = server is not None and not self.silent
        if self.journal is not None:
            self.journal.hand_back(session_id, reason, owed=report)
        self._returned.add(session_id)
        if report:
            assert server is not None
            self.reporter.report(server, self._returned_result(session_id, task_id, reason), dispatch)

    def report_owed(self, live: Container[str]) -> None:
        """Send again every outcome the server has not acknowledged (a restart, a re-registration)."""
        if self.journal is None or self.silent:
            return
        for e in self.journal.owed():
            # To this node's server when it has one (a restarted node reports to where it registers now),
            # else where the session's dispatch said.
            server = self.server_url or e.server_url
            if server is None or self.reporter.sending(e.session_id) or e.session_id in live:
                continue
            if e.state is State.RETURNED:
                result = self._returned_result(e.session_id, e.task_id or "", e.reason or "handed back")
            elif e.result is not None:
                result = e.result
            else:
                continue
            self.reporter.report(server, result, e.dispatch)

    def _returned_result(self, session_id: str, task_id: str, reason: str) -> SessionResult:
        return SessionResult(
            session_id=session_id,
            task_id=task_id,
            node_id=self.node_id,
            status=SessionStatus.REGISTERED,
            reason=reason,
        )

    # -- questions about an id ----------------------------------------------------------------------------
    def result(self, session_id: str) -> SessionResult | None:
        """This process's result for the id (whole, or without its trajectory once old)."""
        return self._results.get(session_id) or self._archived.get(session_id)

    def state(self, session_id: str, in_store: Callable[[str], bool]) -> NodeSessionState | None:
        """What the node has of an id that is not live; None: it does not have it (never admitted, or
        handed back). `in_store`: whether the gateway's store knows the id (a pre-journal store)."""
        result = self.result(session_id)
        if result is not None:
            return NodeSessionState(session_id=session_id, status=result.status, result=result)
        if session_id in self._returned:
            return None
        entry = self.journal.get(session_id) if self.journal is not None else None
        if entry is not None and entry.state in (State.ENDED, State.SETTLED) and entry.status is not None:
            # A previous process's outcome: whole until the server acknowledged it, then status and reason
            kept = entry.result or SessionResult(
                session_id=session_id,
                task_id=entry.task_id or "",
                node_id=self.node_id,
                status=entry.status,
                reason=entry.reason,
            )
            return NodeSessionState(session_id=session_id, status=kept.status, result=kept)
        if entry is not None and entry.state in (State.FENCED, State.RETURNED):
            return None
        if entry is not None or in_store(session_id):
            # Admitted, not live, no outcome: a previous process ran it and died with it.
            lost = SessionResult(
                session_id=session_id,
                task_id="",
                node_id=self.node_id,
                status=SessionStatus.ERROR,
                reason="the node restarted while this session ran; its outcome was lost",  # a pre-journal store
            )
            return NodeSessionState(session_id=session_id, status=lost.status, result=lost)
        return None

    def finished(self) -> list[NodeSessionState]:
        """Every session this process finished, oldest first."""
        return [
            NodeSessionState(session_id=k, status=r.status)
            for results in (self._archived, self._results)
            for k, r in results.items()
        ]
