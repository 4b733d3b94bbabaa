"""What every upstream client offers, and the parsing all OpenAI-shaped chat responses share.

A backend turns a `CanonicalRequest` into the exact OpenAI Chat body sent upstream (the gateway stores that
body), posts it, and reads the answer into a `Completion` with whatever token data the server returned.
Responses are parsed by hand from orjson's output, not through pydantic: this is the per-call hot path, and
every missing or malformed piece needs its own precise error or flag anyway.

Token data is never repaired: ids and logprobs are taken as the server sent them, and anything missing or
inconsistent becomes a flag that makes the record untrainable. Nothing is re-tokenized here.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from polar.gateway.backends.prompt_ids import IdsMemo
from polar.gateway.canonical import CanonicalRequest, Completion, FinishReason, StreamChunk, ToolCall
from polar.gateway.errors import GatewayError
from polar.jsontypes import JSON
from polar.netguard import OutboundPolicy
from polar.store.codec import TokenIds

if TYPE_CHECKING:
    from polar.gateway.render.chain import Chain
from polar.store.records import (
    FLAG_LOGPROB_MISMATCH,
    FLAG_NO_LOGPROBS,
    FLAG_NO_PROMPT_IDS,
    FLAG_NO_RESPONSE_IDS,
    FLAG_NOT_TRAINABLE,
    FLAG_TOOL_PARSE_ERROR,
)


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """Connection settings of one upstream. `retries` counts extra attempts after the first one.

    `outbound`: None for the operator's own policy server; an `OutboundPolicy` for a URL a task named (a
    side call's frozen backend), so every connection to it is checked (`polar.netguard`)."""

    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_connections: int = 512
    retries: int = 2
    retry_backoff_s: float = 0.25
    api_key: str | None = None
    outbound: OutboundPolicy | None = None


class Backend(Protocol):
    """A client of the policy's inference server (or of any OpenAI-compatible endpoint)."""

    kind: str
    url: str

    def build_body(self, req: CanonicalRequest, served_model: str) -> dict[str, Any]:
        """The exact OpenAI Chat body sent upstream: the request, the served model, and the training fields."""
        ...

    async def complete(
        self, body: dict[str, Any], memo: IdsMemo | None = None, chain: Chain | None = None
    ) -> Completion:
        """Send `body` (from `build_body` of a request that is not streamed) and read the answer; raises
        `GatewayError`. `memo`: the session's previous prompt ids, so only new ones are decoded
        (`polar.gateway.backends.prompt_ids`; a kind without prompt ids ignores it). `chain`: the session's
        token chain, which a backend that renders prompts itself continues (`polar.gateway.render`); the
        others ignore it."""
        ...

    def stream(
        self, body: dict[str, Any], memo: IdsMemo | None = None, chain: Chain | None = None
    ) -> AsyncGenerator[StreamChunk, None]:
        """Send `body` (from `build_body` of a streamed request) and yield the answer's chunks as they come
        (`polar.gateway.backends.stream`; a `StreamAccumulator` adds them up to the `Completion`). Raises
        `GatewayError` before the first chunk (refused, unreachable) or mid-stream (dropped connection, an
        error event, a malformed chunk). A kind that cannot stream with token data yields one chunk holding
        the whole answer (`whole_chunk`). Closing the iterator early closes the upstream connection."""
        ...

    async def count_tokens(self, req: CanonicalRequest, served_model: str) -> int:
        """Prompt length of `req` in tokens, as the server would render it (an estimate for `openai`)."""
        ...

    async def check_token_data(self, served_model: str) -> None:
        """Raise `TokenDataMissing` when the server does not return the token data its kind promises."""
        ...

    async def list_models(self) -> list[str]:
        """The model ids the server serves (`GET /v1/models`), for resolving the served model at start-up."""
        ...

    async def start(self) -> None:
        """Open the connection pool; call inside the running event loop."""
        ...

    async def aclose(self) -> None:
        """Close the connection pool."""
        ...


_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "content_filter": "content_filter",
    # Legacy OpenAI name for the same thing; some OpenAI-compatible servers still send it.
    "function_call": "tool_calls",
}


def upstream_error(message: str) -> GatewayError:
    return GatewayError("upstream_error", message)


def chat_body(req: CanonicalRequest, served_model: str) -> dict[str, Any]:
    """The OpenAI Chat body common to every kind; each backend adds its training fields on top."""
    body: dict[str, Any] = {"model": served_model, "messages": req.messages}
    if req.tools:
        body["tools"] = req.tools
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    body.update(req.params)
    # One upstream call per harness call, streamed when the harness streams and the kind can (see
    # `OpenAIBackend.build_body`). vLLM rejects `stream_options` unless `stream` is true ("Stream options can
    # only be defined when `stream=True`"), so a harness's stream_options never leak through.
    body.pop("stream_options", None)
    body["stream"] = False
    return body


def first_choice(data: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(body, choices[0], choices[0].message) of a chat response, or an `upstream_error` naming what is missing."""
    if not isinstance(data, dict):
        raise upstream_error(
            f"inference server answered with JSON that is not an object ({type(data).__name__})"
        )
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise upstream_error("inference server answer has no `choices`")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise upstream_error("inference server answer's `choices[0]` is not an object")
    message = choice.get("message")
    if not isinstance(message, dict):
        raise upstream_error("inference server answer has no `choices[0].message`")
    return data, choice, message


def text_field(message: dict[str, Any], key: str) -> str | None:
    value = message.get(key)
    if value is None or isinstance(value, str):
        return value
    raise upstream_error(f"inference server answer's `message.{key}` is not a string")


def tool_calls(message: dict[str, Any]) -> tuple[tuple[ToolCall, ...], bool]:
    """The structured tool calls and whether any has arguments that are not valid JSON (kept as sent)."""
    raw = message.get("tool_calls")
    if raw is None:
        return (), False
    if not isinstance(raw, list):
        raise upstream_error("inference server answer's `message.tool_calls` is not a list")
    calls: list[ToolCall] = []
    bad_json = False
    for i, item in enumerate(raw):
        fn = item.get("function") if isinstance(item, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise upstream_error(
                f"inference server answer's `message.tool_calls[{i}].function.name` is missing"
            )
        assert isinstance(fn, dict)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                orjson.loads(args)
            except orjson.JSONDecodeError:
                bad_json = True
        elif args is None:
            args = ""
            bad_json = True
        else:
            # A few OpenAI-compatible servers send the arguments as an object; JSON text is the contract.
            args = orjson.dumps(args).decode()
        call_id = item.get("id")
        calls.append(
            ToolCall(
                id=call_id if isinstance(call_id, str) and call_id else f"call_{i}", name=name, arguments=args
            )
        )
    return tuple(calls), bad_json


def finish_reason(choice: dict[str, Any], has_tool_calls: bool) -> FinishReason:
    raw = choice.get("finish_reason")
    if raw is None:
        reason: FinishReason = "stop"
    elif isinstance(raw, str) and raw in _FINISH:
        reason = _FINISH[raw]
    elif raw == "abort":
        # vLLM and SGLang report an aborted request (client gone, server draining) this way.
        raise upstream_error("inference server aborted the generation (finish_reason `abort`)")
    else:
        raise upstream_error(f"inference server answered an unknown finish_reason {raw!r}")
    # vLLM answers a named or `required` tool_choice with finish_reason "stop" although it made tool
    # calls; harnesses decide whether to run tools from the finish reason, so say what happened.
    if has_tool_calls and reason == "stop":
        return "tool_calls"
    return reason


def usage(
    data: dict[str, Any], prompt_ids: Sequence[int] | None, response_ids: list[int] | None
) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) from `usage`, else from the token ids, else 0."""
    u = data.get("usage")
    p = u.get("prompt_tokens") if isinstance(u, dict) else None
    c = u.get("completion_tokens") if isinstance(u, dict) else None
    if type(p) is not int:
        p = len(prompt_ids) if prompt_ids is not None else 0
    if type(c) is not int:
        c = len(response_ids) if response_ids is not None else 0
    return p, c


def int_list(value: JSON) -> list[int] | None:
    """`value` if it is a list of ints, else None (flagged by the caller, never repaired).

    `sum` is the check: it runs in C at a few ns per element (a Python loop costs ~30, `array("q", ...)`
    ~15), raises on anything that is not a number, and turns float as soon as one element is a float.
    orjson decodes every integral JSON number to int, so this is exact for what a server can send.
    """
    if type(value) is not list:
        return None
    try:
        total = sum(value)
    except TypeError:
        return None
    return value if type(total) is int else None


def id_sequence(value: JSON) -> Sequence[int] | None:
    """`int_list`, also taking the `TokenIds` a backend's decoder made (checked when they were decoded)."""
    if type(value) is TokenIds:
        return value
    return int_list(value)


def float_list(value: list[Any]) -> list[float] | None:
    """`value` if every entry is a number (JSON ints such as `0` included), else None."""
    try:
        total = sum(value)
    except TypeError:
        return None
    return value if type(total) in (int, float) else None


def token_flags(
    prompt_ids: Sequence[int] | None, response_ids: list[int] | None, logprobs: list[float] | None
) -> list[str]:
    """Flags for missing or inconsistent token data; any of them makes the record untrainable."""
    flags: list[str] = []
    if prompt_ids is None:
        flags.append(FLAG_NO_PROMPT_IDS)
    if response_ids is None:
        flags.append(FLAG_NO_RESPONSE_IDS)
    if logprobs is None:
        flags.append(FLAG_NO_LOGPROBS)
    elif response_ids is not None and len(logprobs) != len(response_ids):
        flags.append(FLAG_LOGPROB_MISMATCH)
    if flags:
        flags.append(FLAG_NOT_TRAINABLE)
    return flags


def assemble(
    data: dict[str, Any],
    choice: dict[str, Any],
    message: dict[str, Any],
    *,
    content: str | None,
    reasoning: str | None,
    prompt_ids: Sequence[int] | None,
    response_ids: list[int] | None,
    logprobs: list[float] | None,
    policy_version: int | None,
    extra_flags: list[str],
    sampled_text: str | None = None,
) -> Completion:
    """The `Completion` from parsed parts; the flags say what the token data lacks."""
    calls, bad_json = tool_calls(message)
    flags = token_flags(prompt_ids, response_ids, logprobs)
    if bad_json:
        flags.append(FLAG_TOOL_PARSE_ERROR)
    for f in extra_flags:
        if f not in flags:
            flags.append(f)
    p, c = usage(data, prompt_ids, response_ids)
    resp_id = data.get("id")
    model = data.get("model")
    created = data.get("created")
    return Completion(
        id=resp_id if isinstance(resp_id, str) else "",
        model=model if isinstance(model, str) else "",
        content=content,
        reasoning=reasoning,
        tool_calls=calls,
        finish_reason=finish_reason(choice, bool(calls)),
        prompt_tokens=p,
        completion_tokens=c,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_logprobs=logprobs,
        policy_version=policy_version,
        flags=tuple(flags),
        created=created if type(created) is int else 0,
        sampled_text=sampled_text,
    )
