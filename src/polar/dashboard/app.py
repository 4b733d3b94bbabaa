"""The dashboard's routes (all under /ui, served by the rollout server beside its control routes).

Pages are rendered on the server (Jinja2); htmx swaps the parts that change, when the server's event
stream (`/ui/events`, a coalesced view of `GET /events`) says something changed. Every view's state is in
its URL (filters, tab, trace), so a link shows the same thing to whoever else logs in.

    GET  /ui/                       overview: topology, counters, recent tasks (filters in the query)
    GET  /ui/tasks/{id}             a task: its sessions, reward chart, cancel
    GET  /ui/sessions/{id}?tab=...  a session: timeline, conversation, completions, trajectory, tokens,
                                    evaluation, raw
    GET  /ui/compare?s=ID&s=ID      sessions side by side: outcome, timings, tokens, the conversations
                                    aligned (where they first differ), the diff of their answers
    GET  /ui/training               curves of a `polar train` run (--train OUT)
    GET  /ui/search?q=...           a session by id (or its first characters)
    GET  /ui/events                 SSE: `changed` when the server's state did
    POST /ui/tasks/{id}/cancel      cancel (needs the CSRF header)
    POST /ui/login, /ui/logout      see `polar.dashboard.auth`
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from polar.auth import token_matches
from polar.dashboard import compare, queries, training, views
from polar.dashboard.auth import DEFAULT_TTL_S, Caller, Logins, clear_cookie_header, cookie_header, cookie_of
from polar.dashboard.finished import FinishedRun
from polar.dashboard.guard import Guard, Refused
from polar.dashboard.nodes import Fetched, NodeReader
from polar.dashboard.tokens import Decode, side_call_ids, trace_tokens
from polar.jsontypes import JSON
from polar.rollout.protocol import SessionStatus
from polar.rollout.server.service import RolloutService
from polar.rollout.server.store import NodeRow

TABS = ["timeline", "conversation", "completions", "trajectory", "tokens", "evaluation", "raw"]
STATES = ["ACTIVE", "DONE", "CANCELLED"]
COALESCE_S = 0.25  # events this close together make one refresh


@dataclass(frozen=True)
class DashboardOptions:
    train_dir: Path | None = None  # a `polar train` out folder (or its metrics.jsonl)
    tokenizer: str | None = None  # its name, for the page
    decode: Decode | None = None  # token ids -> text (`tokens.load_tokenizer`)
    login_ttl_s: float = DEFAULT_TTL_S


class Dashboard:
    """`service()` is the rollout server's `RolloutService` once started, or a finished run's files
    (`polar dashboard RUN_DIR`); None: a training-only dashboard, `polar dashboard --train`."""

    def __init__(
        self,
        token: str,
        options: DashboardOptions,
        service: Callable[[], RolloutService | FinishedRun | None],
        on_refused: Refused | None = None,
        records: Callable[[str], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.token, self.options, self.service = token, options, service
        # A finished run's records, read from its folder (`finished.FinishedRun`) instead of from nodes.
        self.local_records = records
        self.logins = Logins(options.login_ttl_s)
        self.env = Environment(loader=PackageLoader("polar.dashboard"), autoescape=select_autoescape())
        self.env.filters["ago"] = _ago
        self.env.filters["num"] = _num
        self.env.filters["evaluators"] = views.evaluator_label
        self._reader: NodeReader | None = None
        static = StaticFiles(directory=Path(__file__).parent / "static")
        app = Starlette(
            routes=[
                Route("/ui", self.overview, methods=["GET"]),
                Route("/ui/", self.overview, methods=["GET"]),
                Route("/ui/frag/overview", self.overview_fragment, methods=["GET"]),
                Route("/ui/tasks/{task_id:path}/cancel", self.cancel, methods=["POST"]),
                Route("/ui/frag/tasks/{task_id:path}", self.task_fragment, methods=["GET"]),
                Route("/ui/tasks/{task_id:path}", self.task, methods=["GET"]),
                Route("/ui/sessions/{session_id}", self.session, methods=["GET"]),
                Route("/ui/compare", self.compare_view, methods=["GET"]),
                Route("/ui/training", self.training, methods=["GET"]),
                Route("/ui/search", self.search, methods=["GET"]),
                Route("/ui/events", self.events, methods=["GET"]),
                Route("/ui/login", self.login, methods=["POST"]),
                Route("/ui/logout", self.logout, methods=["POST"]),
                Mount("/ui/static", static),
            ]
        )
        self.asgi = Guard(app, token, self.logins, self._login_page, on_refused)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, send)

    async def aclose(self) -> None:
        if self._reader is not None:
            await self._reader.aclose()

    @property
    def reader(self) -> NodeReader:
        if self._reader is None:
            self._reader = NodeReader(self.token)
        return self._reader

    # -- rendering ----------------------------------------------------------------------------------------
    def _login_page(self, nonce: str) -> str:
        return self.env.get_template("login.html").render(nonce=nonce)

    def render(self, request: Request, name: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        caller: Caller = request.state.caller
        base = {
            "csrf": caller.login.csrf if caller.login else "",
            "has_server": self.service() is not None,
            "has_training": self.options.train_dir is not None,
            "tokenizer": self.options.tokenizer,
            "path": request.url.path,
            "query": request.url.query,
        }
        return HTMLResponse(self.env.get_template(name).render(**base, **ctx), status_code=status)

    def _svc(self) -> RolloutService | FinishedRun:
        svc = self.service()
        if svc is None:  # `polar dashboard --train`: a training page, no rollout server behind it
            raise HTTPException(404, "this dashboard shows a training run only; no rollout server here")
        return svc

    # -- login --------------------------------------------------------------------------------------------
    async def login(self, request: Request) -> Response:
        if not token_matches(request.headers.get("authorization"), self.token):
            await asyncio.sleep(0.2)  # a guess costs time
            return _json({"error": {"message": "wrong control token", "type": "authentication_error"}}, 401)
        login = self.logins.create()
        response = _json({"ok": True})
        secure = request.url.scheme == "https"
        response.headers["set-cookie"] = cookie_header(login, secure, self.logins.ttl_s)
        return response

    async def logout(self, request: Request) -> Response:
        self.logins.drop(cookie_of({k.encode(): v.encode() for k, v in request.headers.items()}))
        response = _json({"ok": True})
        response.headers["set-cookie"] = clear_cookie_header()
        return response

    # -- overview -----------------------------------------------------------------------------------------
    def _filter(self, request: Request) -> queries.TaskFilter:
        q = request.query_params
        state = q.get("state", "")
        return queries.TaskFilter(
            task=q.get("task", "").strip(),
            state=state if state in STATES else "",
            harness=q.get("harness", "").strip(),
            reward_min=_float(q.get("reward_min")),
            reward_max=_float(q.get("reward_max")),
        )

    async def _overview_ctx(self, request: Request) -> dict[str, Any]:
        svc = self._svc()
        flt = self._filter(request)
        nodes = svc.store.nodes()
        loads = {v.node_id: v for v in svc.node_views()}
        health = await self.reader.health([n.url for n in nodes if not n.lost])
        topo = []
        now = time.time()
        for n in nodes:
            view = loads.get(n.node_id)
            answer = health.get(n.url, Fetched(error="node lost"))
            backend = (answer.data or {}).get("backend") or {}
            topo.append(
                {
                    "node": n,
                    "healthy": bool(view and view.healthy and not n.lost),
                    "load": view.load if view else 0,
                    "by_stage": (n.status or {}).get("by_stage", {}),
                    "workers": (n.status or {}).get("workers", {}),
                    "backend": backend.get("url"),
                    "backend_kind": backend.get("kind"),
                    "model": (answer.data or {}).get("model"),
                    "error": answer.error,
                    "heartbeat_ago": now - n.last_heartbeat,
                }
            )
        return {
            "flt": flt,
            "states": STATES,
            "harnesses": queries.harnesses(svc.store),
            "tasks": queries.recent_tasks(svc.store, flt),
            "counters": queries.counters(svc.store),
            "sessions_by_status": svc.store.counts(),
            "topology": topo,
            "server_url": str(request.base_url).rstrip("/"),
        }

    async def overview(self, request: Request) -> Response:
        if self.service() is None:
            return RedirectResponse("/ui/training", 303)
        return self.render(request, "overview.html", **await self._overview_ctx(request))

    async def overview_fragment(self, request: Request) -> Response:
        return self.render(request, "_overview.html", **await self._overview_ctx(request))

    # -- tasks --------------------------------------------------------------------------------------------
    def _task_ctx(self, task_id: str) -> dict[str, Any] | None:
        svc = self._svc()
        row = svc.store.task(task_id)
        if row is None:
            return None
        sessions = queries.sessions_of(svc.store, task_id)
        chart = {
            "title": "reward by sample",
            "x": [s.sample_index for s in sessions],
            "series": {"reward": [s.reward for s in sessions]},
            "points": True,
        }
        rewarded = sorted((s for s in sessions if s.reward is not None), key=lambda s: s.reward or 0.0)
        pair = None
        if len(rewarded) >= 2 and rewarded[0].reward != rewarded[-1].reward:
            pair = (rewarded[-1].session_id, rewarded[0].session_id)
        return {"task_id": task_id, "row": row, "sessions": sessions, "counts": svc.store.counts(task_id),
                "chart": chart, "pair": pair}  # fmt: skip

    async def task(self, request: Request) -> Response:
        ctx = self._task_ctx(request.path_params["task_id"])
        if ctx is None:
            return self.render(request, "missing.html", 404, what=f"task {request.path_params['task_id']}")
        return self.render(request, "task.html", **ctx)

    async def task_fragment(self, request: Request) -> Response:
        ctx = self._task_ctx(request.path_params["task_id"])
        if ctx is None:
            return HTMLResponse("no such task", 404)
        return self.render(request, "_task.html", **ctx)

    async def cancel(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        try:
            cancelled = self._svc().cancel(task_id, "cancelled from the dashboard")
        except KeyError:
            return HTMLResponse(f"no task {task_id}", 404)
        text = "cancelled" if cancelled else "already ended: nothing to cancel"
        return HTMLResponse(f'<span class="note" id="cancel-outcome">{text}</span>')

    # -- sessions -----------------------------------------------------------------------------------------
    async def session(self, request: Request) -> Response:
        sid = request.path_params["session_id"]
        svc = self._svc()
        detail = queries.session(svc.store, sid)
        if detail is None:
            return self.render(request, "missing.html", 404, what=f"session {sid}")
        tab = request.query_params.get("tab", "timeline")
        tab = tab if tab in TABS else "timeline"
        node = svc.store.node(detail.summary.node_id) if detail.summary.node_id else None
        ctx: dict[str, Any] = {"d": detail, "tab": tab, "tabs": TABS, "node": node, "notes": []}
        result = detail.result or {}
        trajectory = result.get("trajectory")
        if tab in ("conversation", "trajectory", "tokens"):
            trajectory = await self._trajectory(detail, node, ctx["notes"])
        records: list[dict[str, Any]] = []
        if tab in ("completions", "tokens", "conversation"):
            records = await self._records(sid, node, ctx["notes"])
        traces = (trajectory or {}).get("traces") or []
        side = side_call_ids(records)
        ctx.update(trajectory=trajectory, traces=traces, records=records, side_ids=side)
        if tab == "timeline":
            ctx["bars"] = views.timeline(detail.timings)
        elif tab == "conversation":
            ctx["conversations"] = [views.conversation(t) for t in traces]
        elif tab == "completions":
            ctx["diffs"] = [views.diff_lines(r.get("request"), r.get("upstream_request")) for r in records]
        elif tab == "tokens":
            decode = self.options.decode
            ctx["token_traces"] = await asyncio.to_thread(
                lambda: [trace_tokens(i, t, decode, side) for i, t in enumerate(traces)]
            )
        elif tab == "raw":
            ctx["raw"] = views.pretty(detail.result) if detail.result else None
        elif tab == "evaluation":
            evaluation = result.get("metadata", {}).get("evaluation")
            ctx["evaluation"] = views.pretty(evaluation)
            ctx["judges"] = [
                views.JudgeSession(
                    judge,
                    cached,
                    await self._records(judge, (svc.store.node(on) if on else None) or node, ctx["notes"]),
                )
                for judge, cached, on in views.judge_sessions(evaluation)
            ]
        return self.render(request, "session.html", **ctx)

    async def _records(self, sid: str, node: NodeRow | None, notes: list[str]) -> list[dict[str, Any]]:
        """A gateway session's records: from the run's folder, or from the node that ran it."""
        if self.local_records is not None:
            return await asyncio.to_thread(self.local_records, sid)
        if node is None:
            notes.append("the session never reached a node: there are no gateway records")
            return []
        fetched = await self.reader.completions(node.url, sid)
        if fetched.error:
            notes.append(f"records of {sid} from node {node.node_id}: {fetched.error}")
        return list(fetched.data or [])

    async def _trajectory(
        self, detail: queries.SessionDetail, node: NodeRow | None, notes: list[str]
    ) -> JSON:
        """The result's trajectory, or (a session not finished) the one its node builds from the calls so far."""
        trajectory = (detail.result or {}).get("trajectory")
        if trajectory is not None or node is None or self.local_records is not None:
            return trajectory
        fetched = await self.reader.trajectory(node.url, detail.summary.session_id)
        if fetched.error:
            notes.append(f"live trajectory from node {node.node_id}: {fetched.error}")
        else:
            notes.append("not finished: the trajectory is built from the calls so far")
        return fetched.data

    async def compare_view(self, request: Request) -> Response:
        ids = list(dict.fromkeys(s.strip() for s in request.query_params.getlist("s") if s.strip()))
        if not compare.MIN_SESSIONS <= len(ids) <= compare.MAX_SESSIONS:
            why = (
                f"pick {compare.MIN_SESSIONS} to {compare.MAX_SESSIONS} sessions to compare (got {len(ids)})"
            )
            return self.render(request, "compare.html", 400, problem=why, ids=ids)
        svc = self._svc()
        details = {sid: queries.session(svc.store, sid) for sid in ids}
        missing = [sid for sid, d in details.items() if d is None]
        if missing:
            return self.render(request, "missing.html", 404, what="session " + ", ".join(missing))
        sides, notes = [], []
        for sid in ids:
            detail = details[sid]
            assert detail is not None
            node = svc.store.node(detail.summary.node_id) if detail.summary.node_id else None
            own: list[str] = []
            trajectory = await self._trajectory(detail, node, own)
            notes += [f"{sid}: {n}" for n in own]
            sides.append(compare.side(detail, trajectory))
        live = any(not SessionStatus(s.detail.summary.status).terminal for s in sides)
        return self.render(request, "compare.html", c=compare.compare(sides), ids=ids, notes=notes, live=live)

    async def search(self, request: Request) -> Response:
        q = request.query_params.get("q", "").strip()
        found = queries.find_sessions(self._svc().store, q) if len(q) >= 4 else []
        if len(found) == 1:
            return RedirectResponse(f"/ui/sessions/{found[0].session_id}", 303)
        return self.render(request, "search.html", q=q, found=found)

    # -- training -----------------------------------------------------------------------------------------
    async def training(self, request: Request) -> Response:
        run = training.read_run(self.options.train_dir) if self.options.train_dir else None
        return self.render(request, "training.html", run=run)

    # -- live ---------------------------------------------------------------------------------------------
    async def events(self, request: Request) -> Response:
        bus = self._svc().events
        sub = bus.subscribe()

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield b": polar dashboard\n\n"
                while True:
                    try:
                        async with asyncio.timeout(15.0):
                            first = await sub.queue.get()
                    except TimeoutError:
                        yield b": keepalive\n\n"
                        continue
                    await asyncio.sleep(COALESCE_S)
                    kinds = {first[1]}
                    while not sub.queue.empty():
                        kinds.add(sub.queue.get_nowait()[1])
                    data = orjson.dumps({"kinds": sorted(kinds)})
                    yield b"event: changed\ndata: " + data + b"\n\n"
            finally:
                bus.unsubscribe(sub)

        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


def _json(body: JSON, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _float(raw: str | None) -> float | None:
    if raw is None or not raw.strip():
        return None
    try:
        return float(raw)
    except ValueError:
        return None


def _ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    if s < 60:
        return f"{s:.0f} s ago"
    if s < 3600:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _num(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if isinstance(v, int) or (abs(v) >= 1000 and v == int(v)) else f"{v:.{digits}f}"
