"""The task's side-call policy (`agent.side_calls`): train on side calls, exclude them, or route them.

Side calls are the records the harness preset's `classify` tags "side_call" (titles, a small model).
- train: nothing changes; they are built like any call.
- exclude: after classification the node flags them `not_trainable` (plus `not_trainable:side_call_excluded`,
  whose prefix also keeps `train_without_logprobs` from re-enabling them), the flag every builder already
  honours: their sampled tokens stay in the trajectory, masked, with logprob 0.0. Nothing is dropped, and the
  audit's coverage stays 1.0 over the calls that remain trainable, provided it is given the same records
  (`apply_policy(records, "exclude")`).
- route: the gateway sends them to a frozen backend at request time (`polar.gateway.routing`), whose records
  it flags `not_trainable` itself; the node only names the route in the gateway session's metadata.
Every policy lists the side calls in the trajectory metadata under "side_calls".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from polar.gateway.routing import FLAG_ROUTED, ROUTE_KEY, SIDE_CALL
from polar.store.records import FLAG_NOT_TRAINABLE, CompletionRecord
from polar.task import AgentConfig

FLAG_EXCLUDED = "not_trainable:side_call_excluded"


def gateway_route(agent: AgentConfig) -> dict[str, Any]:
    """The gateway session metadata that turns routing on (empty unless `side_calls` is "route")."""
    if agent.side_calls != "route" or agent.side_call_backend is None:
        return {}
    return {
        ROUTE_KEY: {
            "harness": agent.harness,
            "settings": dict(agent.settings),
            "backend": agent.side_call_backend.model_dump(),
        }
    }


def apply_policy(
    records: Sequence[CompletionRecord], policy: str
) -> tuple[list[CompletionRecord], dict[str, Any]]:
    """Classified records as the builder must see them under `policy`, and the summary for the metadata."""
    out: list[CompletionRecord] = []
    ids: list[str] = []
    tokens = 0
    for r in records:
        if SIDE_CALL in r.tags:
            ids.append(r.completion_id)
            tokens += len(r.response_ids or ())
            if policy == "exclude":
                r = replace(r, flags=tuple(dict.fromkeys((*r.flags, FLAG_NOT_TRAINABLE, FLAG_EXCLUDED))))
        out.append(r)
    summary: dict[str, Any] = {
        "policy": policy,
        "calls": len(ids),
        "completion_ids": ids,
        "sampled_tokens": tokens,
    }
    if policy == "route":
        summary["routed_completion_ids"] = [r.completion_id for r in out if FLAG_ROUTED in r.flags]
    return out, summary
