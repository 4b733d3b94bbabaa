"""Google Gemini (`POST /v1beta/models/{model}:generateContent` and `:streamGenerateContent`, also under
`/v1`, the google-genai SDK's default API version), as Gemini CLI speaks it. The model and whether to
stream come from the path, not the body; how a request becomes Chat messages is in `gemini_request`.

Responses put `thoughtSignature` (our codec token, base64) on the first non-thought part, so the reasoning
survives a harness that drops thought parts from its history.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson

from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk, StreamHead
from polar.gateway.dialects.base import StreamFormat, sse
from polar.gateway.dialects.gemini.request import encode_signature, parse_request
from polar.gateway.dialects.wire import tool_input
from polar.gateway.errors import GatewayError
from polar.gateway.signatures import ReasoningCodec
from polar.jsontypes import JSON

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
        body: JSON,
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
        last["usageMetadata"] = usage_metadata(comp)
        return chunks

    @staticmethod
    def _chunk(req: CanonicalRequest, comp: Completion, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return chunk(req, comp.id, parts)

    def stream_encoder(
        self, req: CanonicalRequest, codec: ReasoningCodec, fmt: StreamFormat
    ) -> GeminiStreamEncoder:
        return GeminiStreamEncoder(req, codec, fmt, self.error)

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


def chunk(req: CanonicalRequest, response_id: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}],
        "modelVersion": req.model,
        "responseId": response_id,
    }


def usage_metadata(comp: Completion) -> dict[str, int]:
    return {
        "promptTokenCount": comp.prompt_tokens,
        "candidatesTokenCount": comp.completion_tokens,
        "totalTokenCount": comp.prompt_tokens + comp.completion_tokens,
    }


class GeminiStreamEncoder:
    """A Gemini stream as it is sampled (a `StreamEncoder`), as SSE events or as the items of one JSON array
    (`:streamGenerateContent` without `alt=sse`: `[` on `open`, the chunks comma-separated, `]` at the end).

    - every text piece, and every thought piece when the request included thoughts, as one chunk with one
      part, as it comes;
    - a function call as one `functionCall` part when the call is complete (the next call starts, or
      `close`): Gemini carries `args` as an object, which only the whole arguments text gives
      (`wire.tool_input`, with the `_polar_raw_arguments` form for text that is not an object);
    - the `thoughtSignature` on the first part after the reasoning (it signs the whole reasoning, which is
      complete once anything else starts; on the last chunk when nothing follows it);
    - `close`: a last chunk with `finishReason` and `usageMetadata` (Gemini CLI rejects a stream that ends
      without a finish reason), its one part empty unless the signature is still due.
    A failure after `open` is the error object as the stream's last event (or the array's last item).
    """

    def __init__(
        self,
        req: CanonicalRequest,
        codec: ReasoningCodec,
        fmt: StreamFormat,
        error: Callable[[GatewayError], tuple[int, dict[str, Any]]],
    ) -> None:
        self._req = req
        self._codec = codec
        self._array = fmt == "json-array"
        self._error = error
        self._id = ""
        self._sent = 0
        self._show_reasoning = req.render.get("thinking") is not False
        self._thoughts = bool(req.render.get("include_thoughts"))
        self._reasoning: list[str] = []
        self._signed = False
        self._call: list[Any] | None = None  # [index, id, name, [argument pieces]]

    def _frame(self, payload: dict[str, Any]) -> bytes:
        self._sent += 1
        if not self._array:
            return sse(orjson.dumps(payload))
        return (b"," if self._sent > 1 else b"") + orjson.dumps(payload)

    def _part(self, part: dict[str, Any]) -> bytes:
        if self._reasoning and not self._signed and not part.get("thought"):
            part["thoughtSignature"] = encode_signature(self._codec, "".join(self._reasoning))
            self._signed = True
        return self._frame(chunk(self._req, self._id, [part]))

    def open(self, head: StreamHead) -> bytes:
        self._id = head.id
        return b"[" if self._array else b""

    def delta(self, c: StreamChunk) -> bytes:
        out = b""
        if c.reasoning and self._show_reasoning:
            self._reasoning.append(c.reasoning)
            if self._thoughts:
                out += self._part({"text": c.reasoning, "thought": True})
        if c.content:
            out += self._end_call() + self._part({"text": c.content})
        for tc in c.tool_calls:
            if self._call is None or self._call[0] != tc.index:
                out += self._end_call()
                self._call = [tc.index, tc.call_id, tc.name or "", []]
            self._call[3].append(tc.arguments)
        return out

    def _end_call(self) -> bytes:
        if self._call is None:
            return b""
        _, call_id, name, args = self._call
        self._call = None
        return self._part({"functionCall": {"name": name, "args": tool_input("".join(args)), "id": call_id}})

    def close(self, comp: Completion) -> bytes:
        out = self._end_call()
        part: dict[str, Any] = {"text": ""}
        if self._reasoning and not self._signed:
            part["thoughtSignature"] = encode_signature(self._codec, "".join(self._reasoning))
            self._signed = True
        last = chunk(self._req, self._id, [part])
        last["candidates"][0]["finishReason"] = _FINISH.get(comp.finish_reason, "STOP")
        last["usageMetadata"] = usage_metadata(comp)
        out += self._frame(last)
        return out + b"]" if self._array else out

    def fail(self, err: GatewayError) -> bytes:
        out = self._frame(self._error(err)[1])
        return out + b"]" if self._array else out
