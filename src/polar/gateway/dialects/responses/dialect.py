"""OpenAI Responses (`POST /v1/responses`): the only dialect Codex speaks (OpenCode and Pi can, too).

Codex sends `store: false` and its whole history every turn, so everything here is rebuilt from the request
alone; nothing depends on server-side state (`previous_response_id` is refused). The input conversion
lives in `responses_input`, the answer in `responses_render` and `responses_stream`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from polar.gateway.canonical import CanonicalRequest, Completion
from polar.gateway.dialects.base import SSEOnly, StreamFormat
from polar.gateway.dialects.openai_wire import OPENAI_STYLE, settle_tool_choice, upstream_effort
from polar.gateway.dialects.responses import schema as s
from polar.gateway.dialects.responses.input import convert_history, searched_tools
from polar.gateway.dialects.responses.render import error_body, render_response
from polar.gateway.dialects.responses.stream import ResponsesEventWriter, ResponsesStreamEncoder, synthesize
from polar.gateway.dialects.responses.tools import convert_tool_choice, convert_tools
from polar.gateway.dialects.validation import validate
from polar.gateway.errors import GatewayError, invalid
from polar.gateway.signatures import ReasoningCodec
from polar.jsontypes import JSON

INCLUDE_ENCRYPTED = "reasoning.encrypted_content"


class ResponsesDialect(SSEOnly):
    """The OpenAI Responses dialect (see `Dialect` in `dialects.base`)."""

    name = "responses"

    def parse(
        self,
        body: JSON,
        codec: ReasoningCodec,
        *,
        path_model: str | None = None,
        path_stream: bool | None = None,
    ) -> CanonicalRequest:
        req = validate(s.REQUEST, body, OPENAI_STYLE)
        _refuse_server_state(req)

        converted = convert_tools(req.get("tools"))
        tools = converted.tools
        tool_choice = settle_tool_choice(
            convert_tool_choice(req.get("tool_choice"), converted.callable), bool(tools)
        )

        messages: list[dict[str, Any]] = []
        instructions = req.get("instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
        items = req["input"]
        custom, namespaced = converted.custom, converted.namespaced
        loaded_tools: list[dict[str, Any]] = []
        if isinstance(items, str):
            messages.append({"role": "user", "content": items})
        else:
            # Tools a client-executed tool search loaded are callable from there on: their calls answer
            # in kind (namespace, custom) like the request's own tools.
            loaded = searched_tools(items)
            for more in loaded.values():
                custom, namespaced = custom | more.custom, {**more.namespaced, **namespaced}
                loaded_tools.extend(more.tools)
            messages.extend(convert_history(items, codec, loaded))
        if not messages:
            raise invalid("'input' must contain at least one item.", "input")

        reasoning = req.get("reasoning") or {}
        max_output_tokens = req.get("max_output_tokens")
        parallel = req.get("parallel_tool_calls")
        params: dict[str, Any] = {}
        for key, value in (
            ("temperature", req.get("temperature")),
            ("top_p", req.get("top_p")),
            ("top_k", req.get("top_k")),
            ("max_tokens", max_output_tokens),
            ("seed", req.get("seed")),
            ("parallel_tool_calls", parallel),
            ("reasoning_effort", upstream_effort(reasoning.get("effort"))),
            ("response_format", response_format((req.get("text") or {}).get("format"))),
        ):
            if value is not None:
                params[key] = value

        # What the answer echoes back, taken from the body as sent (no copies, no re-validation).
        store = req.get("store")
        render: dict[str, Any] = {
            "model": req["model"],
            "custom_tools": custom,
            "namespaced_tools": namespaced,
            "tool_search": converted.search,
            "dropped_tools": converted.dropped,
            "include_encrypted": INCLUDE_ENCRYPTED in (req.get("include") or ()),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": parallel if parallel is not None else True,
            "temperature": req.get("temperature"),
            "top_p": req.get("top_p"),
            "max_output_tokens": max_output_tokens,
            "reasoning": body.get("reasoning"),
            "metadata": req.get("metadata"),
            "prompt_cache_key": req.get("prompt_cache_key"),
            "store": store if store is not None else True,
            "text": req.get("text"),
        }
        return CanonicalRequest(
            model=req["model"],
            messages=messages,
            tools=tools or None,
            tool_choice=tool_choice,
            params=params,
            stream=bool(req.get("stream")),
            render=render,
            loaded_tools=tuple(loaded_tools),
        )

    def render(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> dict[str, Any]:
        return render_response(req, comp, codec)

    def stream(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> Iterator[bytes]:
        return synthesize(req, comp, codec)

    def stream_encoder(
        self, req: CanonicalRequest, codec: ReasoningCodec, fmt: StreamFormat
    ) -> ResponsesStreamEncoder:
        self._sse_only(fmt)
        return ResponsesStreamEncoder(req, codec)

    def error(self, err: GatewayError) -> tuple[int, dict[str, Any]]:
        return err.status, {"error": error_body(err)}

    def stream_error(self, err: GatewayError) -> bytes:
        return ResponsesEventWriter().failed(error_body(err))

    def stream_error_status(self, err: GatewayError) -> int:
        return 200


def _refuse_server_state(req: s.ResponsesRequest) -> None:
    if req.get("previous_response_id") is not None:
        raise invalid(
            "'previous_response_id' is not supported: this server keeps no responses; send the full "
            "history in 'input' (store: false).",
            "previous_response_id",
        )
    if req.get("conversation") is not None:
        raise invalid("'conversation' is not supported: send the full history in 'input'.", "conversation")
    if req.get("prompt") is not None:
        raise invalid("'prompt' (stored prompt templates) is not supported.", "prompt")
    if req.get("background"):
        raise invalid("'background' responses are not supported.", "background")


def response_format(fmt: Any) -> dict[str, Any] | None:
    """Responses' `text.format` as the chat `response_format` the upstream server constrains its sampling
    to (the schema's fields sit one level down there, under `json_schema`); `text`, the default, is left out
    so the upstream body of a harness that spells it out stays what it always was."""
    if not isinstance(fmt, dict) or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    keys = ("name", "schema", "description", "strict")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if fmt.get(k) is not None}}
