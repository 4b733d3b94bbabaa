"""Google Gemini (`POST /v1beta/models/{model}:generateContent` and `:streamGenerateContent`, also under
`/v1`, the google-genai SDK's default API version), as Gemini CLI speaks it. The model and whether to
stream come from the path, not the body; how a request becomes Chat messages is in `gemini_request`.

Responses put `thoughtSignature` (our codec token, base64) on the first non-thought part, so the reasoning
survives a harness that drops thought parts from its history.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from polar.gateway.canonical import CanonicalRequest, Completion
from polar.gateway.dialects.base import sse
from polar.gateway.dialects.gemini_request import encode_signature, parse_request
from polar.gateway.dialects.wire import tool_input
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec

_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}

_STATUS = {
    "invalid_request": "INVALID_ARGUMENT",
    "context_length": "INVALID_ARGUMENT",
    "request_too_large": "INVALID_ARGUMENT",
    "authentication": "UNAUTHENTICATED",
    "permission": "PERMISSION_DENIED",
    "not_found": "NOT_FOUND",
    "rate_limit": "RESOURCE_EXHAUSTED",
    "upstream_error": "INTERNAL",
    "overloaded": "UNAVAILABLE",
    "timeout": "DEADLINE_EXCEEDED",
}


class GeminiDialect:
    """The Gemini API."""

    name = "gemini"

    # ---- requests ----------------------------------------------------------------------------------

    def parse(
        self,
        body: Any,
        codec: ReasoningCodec,
        *,
        path_model: str | None = None,
        path_stream: bool | None = None,
    ) -> CanonicalRequest:
        return parse_request(body, codec, path_model, path_stream)

    # ---- responses ---------------------------------------------------------------------------------

    def render(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> dict[str, Any]:
        chunks = self._chunks(req, comp, codec)
        if len(chunks) == 1:
            return chunks[0]
        parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
        last = chunks[-1]
        last["candidates"][0]["content"]["parts"] = parts
        return last

    def stream(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> Iterator[bytes]:
        for chunk in self._chunks(req, comp, codec):
            yield sse(orjson.dumps(chunk))

    def stream_json(
        self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec
    ) -> list[dict[str, Any]]:
        """`:streamGenerateContent` without `alt=sse` answers one JSON array of the stream's chunks."""
        return self._chunks(req, comp, codec)

    def _chunks(self, req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> list[dict[str, Any]]:
        """The response as stream chunks: thought, text, function calls; the last one carries finishReason
        and usage (Gemini CLI rejects a stream that ends without a finish reason)."""
        groups: list[list[dict[str, Any]]] = []
        signature = None
        reasoning = comp.reasoning if comp.reasoning and req.render.get("thinking") is not False else None
        if reasoning is not None:
            signature = encode_signature(codec, reasoning)
            if req.render.get("include_thoughts"):
                groups.append([{"text": reasoning, "thought": True}])
        if comp.content:
            groups.append([{"text": comp.content}])
        if comp.tool_calls:
            groups.append(
                [
                    {"functionCall": {"name": tc.name, "args": tool_input(tc.arguments), "id": tc.id}}
                    for tc in comp.tool_calls
                ]
            )
        if signature is not None:
            # On the first non-thought part, so reasoning survives a harness that drops thought parts.
            first = next((grp for grp in groups if not grp[0].get("thought")), None)
            if first is None:
                first = [{"text": ""}]
                groups.append(first)
            first[0]["thoughtSignature"] = signature
        if not groups:
            groups.append([{"text": ""}])
        chunks = [self._chunk(req, comp, parts) for parts in groups]
        last = chunks[-1]
        last["candidates"][0]["finishReason"] = _FINISH.get(comp.finish_reason, "STOP")
        last["usageMetadata"] = {
            "promptTokenCount": comp.prompt_tokens,
            "candidatesTokenCount": comp.completion_tokens,
            "totalTokenCount": comp.prompt_tokens + comp.completion_tokens,
        }
        return chunks

    @staticmethod
    def _chunk(req: CanonicalRequest, comp: Completion, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}],
            "modelVersion": req.model,
            "responseId": comp.id,
        }

    # ---- errors ------------------------------------------------------------------------------------

    def error(self, err: GatewayError) -> tuple[int, dict[str, Any]]:
        message = err.message
        if err.kind == "context_length" and err.prompt_tokens is not None and err.max_tokens is not None:
            message = (
                f"The input token count ({err.prompt_tokens}) exceeds the maximum number of tokens allowed "
                f"({err.max_tokens})."
            )
        return err.status, {"error": {"code": err.status, "message": message, "status": _STATUS[err.kind]}}

    def stream_error(self, err: GatewayError) -> bytes:
        """The error as one SSE event, `data: {"error": {...}}`, which google-genai (Python) raises on."""
        return sse(orjson.dumps(self.error(err)[1]))

    def stream_error_status(self, err: GatewayError) -> int:
        """The error's own status, not 200: @google/genai (JS 1.52.0, in Pi 0.73.1 and Gemini CLI) raises on
        an in-stream error only when a network read is a bare JSON object, and reads a `data:` error event
        as an empty answer (Pi then exited 0 with nothing said). On a non-2xx status both SDKs raise before
        reading the stream (JS `throwErrorIfNotOK`, Python `APIError.raise_for_response`), with the status
        their retry logic keys on."""
        return err.status
