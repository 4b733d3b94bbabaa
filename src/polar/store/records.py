"""What the gateway captures, as plain frozen values.

A `CompletionRecord` is one successful model call with the exact token data the server returned; a
`FailureRecord` is a call that did not complete (never mistaken for a completion). Trajectories, rollouts and
training read only these. `to_json`/`from_json` give the wire form served by `GET /sessions/{id}/completions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Record flags (set by the gateway, read by builders, rewards and trainers). A flagged record keeps everything
# the backend returned; trajectories mask what is unsure.
FLAG_NO_PROMPT_IDS = "missing_prompt_ids"
FLAG_NO_RESPONSE_IDS = "missing_response_ids"
FLAG_NO_LOGPROBS = "missing_logprobs"
FLAG_LOGPROB_MISMATCH = "logprob_count_mismatch"
FLAG_NOT_TRAINABLE = "not_trainable"
FLAG_TOOL_PARSE_ERROR = "tool_call_parse_error"
# A streamed answer whose sampled ids do not add up to the server's own `usage.completion_tokens` (a chunk
# was lost, or the server skipped chunks whose text its parsers held back).
FLAG_TOKEN_COUNT_MISMATCH = "token_count_mismatch"
# The harness asked for more output tokens than the server's context had room for after the prompt; the
# gateway sent what fits instead of answering the server's 400 (`polar.gateway.fit`). A second flag,
# `max_tokens_requested:N`, keeps what was asked; `upstream_request` holds what was sent.
FLAG_MAX_TOKENS_CLAMPED = "max_tokens_clamped"


@dataclass(frozen=True, slots=True)
class CompletionRecord:
    session_id: str
    seq: int  # order of the call within its session (shared with failures; gaps are failed calls)
    completion_id: str  # the gateway's own, unique (what the inference server called it: `upstream_id`)
    dialect: str  # "chat" | "responses" | "anthropic" | "gemini"
    created_at: float  # unix seconds when the call arrived
    request: dict[str, Any]  # the harness's original body, as sent
    upstream_request: dict[str, Any]  # the canonical OpenAI Chat body sent to the backend
    prompt_ids: Sequence[int] | None  # list[int] read back; TokenIds from the gateway
    response_ids: list[int] | None
    response_logprobs: list[float] | None
    finish_reason: str
    response_message: dict[str, Any]  # OpenAI Chat assistant message (content, reasoning_content, tool_calls)
    tools: list[dict[str, Any]] | None  # canonical (OpenAI Chat) tools given to the policy
    usage: dict[str, int]  # prompt_tokens, completion_tokens
    model_requested: str
    model_served: str
    policy_version: int | None = None
    upstream_latency_ms: float = 0.0
    gateway_overhead_ms: float = 0.0
    flags: tuple[str, ...] = ()  # see polar.gateway.canonical FLAG_*
    tags: tuple[str, ...] = ()  # e.g. "side_call" from a harness preset's classifier
    # The inference server's id of the completion (the `id` the harness was answered with); servers repeat
    # them (a restarted one counts again, two count alike), so nothing is keyed by it.
    upstream_id: str = ""

    @property
    def trainable(self) -> bool:
        """True when every sampled token has an id and a logprob the server produced."""
        return (
            self.prompt_ids is not None
            and self.response_ids is not None
            and self.response_logprobs is not None
            and len(self.response_ids) == len(self.response_logprobs)
            and "not_trainable" not in self.flags
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["flags"] = list(self.flags)
        d["tags"] = list(self.tags)
        d["trainable"] = self.trainable
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CompletionRecord:
        names = cls.__dataclass_fields__
        kw = {k: v for k, v in d.items() if k in names}
        kw["flags"] = tuple(kw.get("flags", ()))
        kw["tags"] = tuple(kw.get("tags", ()))
        return cls(**kw)


@dataclass(frozen=True, slots=True)
class FailureRecord:
    session_id: str
    seq: int
    dialect: str
    created_at: float
    status: int
    kind: str  # polar.gateway.errors.ErrorKind
    message: str
    request: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    created_at: float
    status: str  # "open" | "closed"
    metadata: dict[str, Any] = field(default_factory=dict)
    completions: int = 0
    failures: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
