"""The dashboard's reads from gateway nodes: a session's records and live trajectory, a node's backend.

The records (what the harness sent, what went upstream, token ids, logprobs) stay in the store of the
node that ran the session; the rollout server knows that node's control URL and token, so it fetches them
when a page asks and relays them. The browser never talks to a node, and nothing here is cached beyond a
node's `/health` for a few seconds (the topology refreshes often).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from polar.auth import bearer
from polar.jsontypes import JSON
from polar.rollout.protocol import error_message

HEALTH_TTL_S = 5.0


@dataclass(frozen=True)
class Fetched:
    """A node's answer (`data`) or why there is none (`error`, shown on the page)."""

    data: JSON = None
    error: str | None = None


class NodeReader:
    def __init__(self, token: str, timeout_s: float = 5.0) -> None:
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=bearer(token))
        self._health: dict[str, tuple[float, Fetched]] = {}

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _get(self, url: str) -> Fetched:
        try:
            r = await self._client.get(url)
        except httpx.HTTPError as exc:
            return Fetched(error=f"the node did not answer ({type(exc).__name__}: {exc})")
        if r.status_code != 200:
            message = error_message(r.content) or r.text[:200]
            return Fetched(error=f"the node answered HTTP {r.status_code}: {message}")
        try:
            return Fetched(r.json())
        except ValueError:
            return Fetched(error="the node's answer is not JSON")

    async def completions(self, node_url: str, session_id: str) -> Fetched:
        fetched = await self._get(f"{node_url}/sessions/{session_id}/completions")
        if fetched.data is not None:
            return Fetched(fetched.data.get("completions", []))
        return fetched

    async def trajectory(self, node_url: str, session_id: str) -> Fetched:
        """Built by the node's gateway from the records so far: a running session's trajectory."""
        return await self._get(f"{node_url}/sessions/{session_id}/trajectory")

    async def health(self, node_urls: list[str]) -> dict[str, Fetched]:
        """Each node's gateway `/health` (model, backend kind and URL, paused, in flight)."""
        now = time.monotonic()
        stale = [u for u in node_urls if u not in self._health or now - self._health[u][0] > HEALTH_TTL_S]
        answers = await asyncio.gather(*(self._get(f"{u}/health") for u in stale))
        for url, answer in zip(stale, answers, strict=True):
            self._health[url] = (now, answer)
        return {u: self._health[u][1] for u in node_urls}
