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

An evaluator's own model calls (a judge) go through a session of their own, which the node opens with

    {"evaluator_route": {"tag": "judge", "backend": {"url": ..., "kind": "vllm", "model": "judge"}}}

Every call of such a session goes to that frozen backend, its record tagged `tag` and flagged
`not_trainable` and `routed:<tag>`. Only the control plane creates sessions, so no policy session can
carry this key (the node refuses it in a task's metadata), and a policy session's calls always go to the
policy: the model name a harness asks for is replaced by the served one, whatever it names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polar.gateway.canonical import CanonicalRequest
from polar.store.records import CompletionRecord

ROUTE_KEY = "side_call_route"
SIDE_CALL = "side_call"
# On a routed call's record: the frozen model answered (with `not_trainable`, whatever its server's kind).
FLAG_ROUTED = "routed:side_call"
EVALUATOR_ROUTE_KEY = "evaluator_route"
_TAG = re.compile(r"[a-z][a-z0-9_]{0,31}")

BACKEND_KINDS = ("openai", "vllm", "sglang")

Classify = Callable[[CompletionRecord], tuple[str, ...]]
# (harness name, settings) -> that harness's classifier; raises ValueError for a harness it cannot build.
Classifiers = Callable[[str, dict[str, Any]], Classify]


@dataclass(frozen=True)
class SideRoute:
    """Where a session's routed calls go: its side calls, found by the preset's classifier, or (`classify`
    None: an evaluator's session) every call, tagged `tag`. `flag` marks their records."""

    classify: Classify | None
    kind: str
    url: str
    model: str
    tag: str = SIDE_CALL
    flag: str = FLAG_ROUTED


def _backend(key: str, spec: dict[str, Any]) -> tuple[str, str, str]:
    backend = spec.get("backend")
    if not isinstance(backend, dict):
        raise ValueError(f"{key}.backend must be an object with url, kind and model")
    kind, url, model = backend.get("kind", "openai"), backend.get("url"), backend.get("model")
    if kind not in BACKEND_KINDS:
        raise ValueError(f"{key}.backend.kind must be one of {', '.join(BACKEND_KINDS)}, not {kind!r}")
    for name, value in (("url", url), ("model", model)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{key}.backend.{name} must be a non-empty string")
    return str(kind), str(url), str(model)


def _evaluator_route(spec: Any) -> SideRoute:
    key = EVALUATOR_ROUTE_KEY
    if not isinstance(spec, dict):
        raise ValueError(f"{key} must be an object")
    tag = spec.get("tag")
    if not isinstance(tag, str) or not _TAG.fullmatch(tag):
        raise ValueError(f"{key}.tag must be a lower-case name (letters, digits, _), not {tag!r}")
    kind, url, model = _backend(key, spec)
    return SideRoute(classify=None, kind=kind, url=url, model=model, tag=tag, flag=f"routed:{tag}")


def side_route(metadata: dict[str, Any], classifiers: Classifiers | None) -> SideRoute | None:
    """The route a session's metadata asks for, or None; raises ValueError naming the bad field."""
    spec = metadata.get(ROUTE_KEY)
    if EVALUATOR_ROUTE_KEY in metadata:
        if spec is not None:
            raise ValueError(f"{ROUTE_KEY} and {EVALUATOR_ROUTE_KEY} cannot both be set")
        return _evaluator_route(metadata[EVALUATOR_ROUTE_KEY])
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"{ROUTE_KEY} must be an object")
    kind, url, model = _backend(ROUTE_KEY, spec)
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
    return SideRoute(classify=classify, kind=kind, url=url, model=model)


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
