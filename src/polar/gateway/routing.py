"""Side-call routing: send a harness's side calls (titles, a small model) to a frozen model at request time.

A session opts in through its metadata (the rollout node writes it for `agent.side_calls: route`):

    {"side_call_route": {"harness": "opencode", "settings": {...},
                         "backend": {"url": "http://frozen:8000", "kind": "vllm", "model": "judge"}}}

The gateway asks the harness preset's `classify` (built once per session by the `Classifiers` factory its
owner injects: the node, or `polar gateway`, pass `polar.harness.registry.classifier`; the gateway itself
knows no harness) about a provisional record of each incoming call (the request, its canonical tools and
upstream body; no token data yet). A call tagged "side_call" goes to the frozen backend; its record is
flagged so no builder trains on it. Sessions without this key are never classified: routing costs them
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polar.gateway.canonical import CanonicalRequest
from polar.store.records import CompletionRecord

ROUTE_KEY = "side_call_route"
SIDE_CALL = "side_call"
# On a routed call's record: the frozen model answered (with `not_trainable`, whatever its server's kind).
FLAG_ROUTED = "routed:side_call"

BACKEND_KINDS = ("openai", "vllm", "sglang")

Classify = Callable[[CompletionRecord], tuple[str, ...]]
# (harness name, settings) -> that harness's classifier; raises ValueError for a harness it cannot build.
Classifiers = Callable[[str, dict[str, Any]], Classify]


@dataclass(frozen=True)
class SideRoute:
    """Where a session's side calls go, and the preset's classifier that finds them."""

    classify: Classify
    kind: str
    url: str
    model: str


def side_route(metadata: dict[str, Any], classifiers: Classifiers | None) -> SideRoute | None:
    """The route a session's metadata asks for, or None; raises ValueError naming the bad field."""
    spec = metadata.get(ROUTE_KEY)
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"{ROUTE_KEY} must be an object")
    backend = spec.get("backend")
    if not isinstance(backend, dict):
        raise ValueError(f"{ROUTE_KEY}.backend must be an object with url, kind and model")
    kind, url, model = backend.get("kind", "openai"), backend.get("url"), backend.get("model")
    if kind not in BACKEND_KINDS:
        raise ValueError(f"{ROUTE_KEY}.backend.kind must be one of {', '.join(BACKEND_KINDS)}, not {kind!r}")
    for name, value in (("url", url), ("model", model)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{ROUTE_KEY}.backend.{name} must be a non-empty string")
    harness, settings = spec.get("harness"), spec.get("settings", {})
    if not isinstance(harness, str) or not harness:
        raise ValueError(f"{ROUTE_KEY}.harness must name a harness preset or import path")
    if not isinstance(settings, dict):
        raise ValueError(f"{ROUTE_KEY}.settings must be an object")
    if classifiers is None:
        raise ValueError(f"{ROUTE_KEY}: this gateway was started without harness classifiers")
    try:
        classify = classifiers(harness, dict(settings))
    except Exception as exc:
        raise ValueError(f"{ROUTE_KEY}.harness {harness!r}: {exc}") from None
    return SideRoute(classify=classify, kind=str(kind), url=str(url), model=str(model))


def provisional_record(
    session_id: str, seq: int, dialect: str, body: Any, upstream: dict[str, Any], req: CanonicalRequest
) -> CompletionRecord:
    """What `classify` sees before the call is served: everything but the answer and its tokens."""
    return CompletionRecord(
        session_id=session_id,
        seq=seq,
        completion_id="",
        dialect=dialect,
        created_at=0.0,
        request=body if isinstance(body, dict) else {},
        upstream_request=upstream,
        prompt_ids=None,
        response_ids=None,
        response_logprobs=None,
        finish_reason="",
        response_message={},
        tools=req.tools,
        usage={},
        model_requested=req.model,
        model_served="",
    )
