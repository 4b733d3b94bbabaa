"""Frozen models for evaluators, through the node's own gateway (`polar.evaluate.base.EvaluatorModels`).

A judge's calls are a gateway session of their own, created here on the control side (as the node creates
a policy session, `gateway_link`) with an `evaluator_route` (`polar.gateway.routing`): every
call of it goes to the judge backend, recorded, tagged and never trainable. Its id, the API key, is random
and made after the agent's run ended, and the session is closed once judged: no sandbox learns a key that
opens the judge. The evaluator calls the model API like a harness does, on the node's own loopback address.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polar.evaluate.base import ModelSession
from polar.gateway.routing import EVALUATOR_ROUTE_KEY
from polar.rollout.node.gateway_link import NodeGateway

JUDGED_SESSION = "judged_session"  # in a judge session's metadata: the session it judged


class GatewayModels:
    def __init__(self, gateway: NodeGateway, state_path: Path) -> None:
        self._gateway = gateway
        self._state_path = state_path

    @property
    def state_path(self) -> Path | None:
        return self._state_path

    async def open_session(
        self, tag: str, backend: Mapping[str, str], judged: str, metadata: Mapping[str, Any]
    ) -> ModelSession:
        route = {"tag": tag, "backend": dict(backend)}
        meta = {**metadata, JUDGED_SESSION: judged, EVALUATOR_ROUTE_KEY: route}
        session_id = f"{tag}-{secrets.token_urlsafe(18)}"
        await self._gateway.open(meta, session_id)
        return ModelSession(
            session_id=session_id, base_url=f"{self._gateway.url_for(session_id).rstrip('/')}/v1"
        )

    async def close_session(self, session_id: str) -> None:
        await self._gateway.close(session_id)
