"""The control plane of a gateway with several workers: each request goes where its state is.

Every worker serves the control routes over its own proxy (`polar.gateway.control`); this router, inside
the token check, sends a request about one session to that session's owner (creating one included: the id
is chosen here, so the new session starts on its owner), applies pause, resume and backend changes on every
worker (each has its own gate and server pool), and sums `/metrics` and `/health` over all of them.
Requests it sends to other workers carry `LOCAL`, so they are served there as they are.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from polar.gateway.forward import Forwarder, WorkerSet

LOCAL = b"x-polar-worker-local"
BROADCAST = frozenset(("/admin/pause", "/admin/resume", "/admin/backends"))
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


class ControlRouter:
    def __init__(self, app: Any, workers: WorkerSet, forward: Forwarder) -> None:
        self.app, self.workers, self.forward = app, workers, forward

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or any(name == LOCAL for name, _ in scope["headers"]):
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path == "/sessions" and method == "POST":
            await self._create(scope, receive, send)
        elif path.startswith("/sessions/"):
            k = self.workers.owner(path.split("/")[2])
            if k == self.workers.index:
                await self.app(scope, receive, send)
            else:
                await self.forward(self.workers.control_urls[k], scope, receive, send)
        elif path in BROADCAST and method == "POST":
            await self._everywhere(scope, await _read(receive), send, _first_failure_or_own)
        elif path == "/metrics" and method == "GET":
            await self._everywhere(scope, b"", send, _summed_metrics)
        elif path == "/health" and method == "GET":
            await self._everywhere(scope, b"", send, _health)
        else:
            await self.app(scope, receive, send)

    async def _create(self, scope: Any, receive: Any, send: Any) -> None:
        """Choose the new session's id here (the registry's form) unless the body names one, and create it
        on its owner; a body that is not a JSON object is answered by this worker's handler (a 400)."""
        raw = await _read(receive)
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict) or ("session_id" in body and not isinstance(body["session_id"], str)):
            await self.app(scope, _replay(raw), send)
            return
        sid = body.setdefault("session_id", "polar-" + secrets.token_urlsafe(18))
        raw = orjson.dumps(body)
        scope = _with_body(scope, raw)
        k = self.workers.owner(sid)
        if k == self.workers.index:
            await self.app(scope, _replay(raw), send)
        else:
            await self.forward(self.workers.control_urls[k], scope, _replay(raw), send)

    async def _everywhere(
        self, scope: Any, raw: bytes, send: Any, combine: Callable[[list[Answer], int], Answer]
    ) -> None:
        """The request on this worker and, marked `LOCAL`, on every other; one answer made by `combine` from
        the workers' answers in their order."""
        me = self.workers.index
        answers = await asyncio.gather(
            *(
                self._local(scope, raw) if i == me else _remote(u, scope, raw)
                for i, u in enumerate(self.workers.control_urls)
            )
        )
        status, headers, body = combine(list(answers), me)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _local(self, scope: Any, raw: bytes) -> Answer:
        got: dict[str, Any] = {"status": 500, "headers": [], "body": []}

        async def capture(message: Any) -> None:
            if message["type"] == "http.response.start":
                got["status"], got["headers"] = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                got["body"].append(message.get("body", b""))

        await self.app(_with_body(scope, raw), _replay(raw), capture)
        return got["status"], got["headers"], b"".join(got["body"])


async def _remote(base_url: str, scope: Any, raw: bytes) -> Answer:
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"}
    headers[LOCAL.decode()] = "1"
    url = (
        base_url + scope["path"] + ("?" + scope["query_string"].decode() if scope.get("query_string") else "")
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.request(scope["method"], url, data=raw or None, headers=headers) as r,
        ):
            return r.status, [(b"content-type", r.content_type.encode())], await r.read()
    except aiohttp.ClientError as exc:
        message = f"worker at {base_url} is not reachable: {exc}"
        return 503, [(b"content-type", b"application/json")], orjson.dumps({"error": {"message": message}})


def _first_failure_or_own(answers: list[Answer], own: int) -> Answer:
    """Pause, resume, a backend change: every worker's answer must be a success; pause sums the calls in
    flight and is drained only when every worker is."""
    failed = [a for a in answers if a[0] >= 300]
    if failed:
        return _with_length(failed[0])
    status, _, body = answers[own]
    data = orjson.loads(body)
    if "drained" in data:
        parts = [orjson.loads(a[2]) for a in answers]
        data["drained"] = all(p["drained"] for p in parts)
        data["in_flight"] = sum(p["in_flight"] for p in parts)
    return _json(status, data)


def _health(answers: list[Answer], own: int) -> Answer:
    parts = [orjson.loads(a[2]) if a[0] == 200 else {"status": "unreachable"} for a in answers]
    data = dict(parts[own])
    data["in_flight"] = sum(p.get("in_flight", 0) for p in parts)
    data["workers"] = [
        {k: p.get(k) for k in ("worker", "pid", "status", "paused", "in_flight")} for p in parts
    ]
    if any(p.get("status") != "ok" for p in parts):
        data["status"] = "degraded"
    return _json(200, data)


# Gauges that are a state, not an amount: the gateway is paused if any worker is, a server up if every
# worker sees it up.
_COMBINE: dict[str, Callable[[float, float], float]] = {
    "polar_gateway_paused": max,
    "polar_gateway_backend_up": min,
}


def _summed_metrics(answers: list[Answer], own: int) -> Answer:
    """One exposition for the gateway: each sample summed over the workers (counters, histogram buckets,
    and the gauges of load and sessions, all of which add up), the state gauges in `_COMBINE` combined."""
    order: list[tuple[str, str, str]] = []
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for status, _, body in answers:
        if status != 200:
            continue
        for family in text_string_to_metric_families(body.decode()):
            if family.name not in samples:
                order.append((family.name, family.type, family.documentation))
                samples[family.name] = {}
            into = samples[family.name]
            for s in family.samples:
                if s.name.endswith("_created"):  # a start time, not an amount: no sum of it means anything
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                combine = _COMBINE.get(s.name)
                if key not in into:
                    into[key] = s.value
                elif combine is not None:
                    into[key] = combine(into[key], s.value)
                else:
                    into[key] += s.value
    lines: list[str] = []
    for name, kind, doc in order:
        doc = doc.replace("\\", "\\\\").replace("\n", "\\n")
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for (sample, labels), value in samples[name].items():
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{sample}{{{text}}} {value!r}" if text else f"{sample} {value!r}")
    body = ("\n".join(lines) + "\n").encode()
    return 200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"), _length(body)], body


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _json(status: int, data: Any) -> Answer:
    body = orjson.dumps(data)
    return status, [(b"content-type", b"application/json"), _length(body)], body


def _length(body: bytes) -> tuple[bytes, bytes]:
    return b"content-length", str(len(body)).encode()


def _with_length(answer: Answer) -> Answer:
    status, headers, body = answer
    return status, [h for h in headers if h[0] != b"content-length"] + [_length(body)], body


def _with_body(scope: Any, raw: bytes) -> Any:
    headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"transfer-encoding")]
    return {**scope, "headers": [*headers, _length(raw)]}


async def _read(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(raw: bytes) -> Callable[[], Awaitable[Any]]:
    sent = False

    async def receive() -> Any:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # as a connection that stays open
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return receive
