"""The Responses streaming grammar: `event:` + `data:` frames numbered by `sequence_number`.

`ResponsesEventWriter` has one method per event kind, so an incremental upstream can drive it token by token;
`synthesize` drives it from one finished `Completion`, the way OpenAI would have streamed it:

    response.created, response.in_progress,
    per output item: response.output_item.added,
        reasoning: reasoning_summary_part.added, reasoning_summary_text.delta*, .done, summary_part.done
        message:   content_part.added, output_text.delta*, output_text.done, content_part.done
        function:  function_call_arguments.delta*, function_call_arguments.done
        custom:    custom_tool_call_input.delta*, custom_tool_call_input.done
    response.output_item.done, ...,
    response.completed (or response.incomplete when the policy hit max_output_tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from polar.gateway.canonical import CanonicalRequest, Completion
from polar.gateway.dialects.openai_wire import split_text, unix_now
from polar.gateway.dialects.responses_render import (
    OutputItem,
    base_id,
    final_status,
    output_items,
    response_object,
    usage,
)
from polar.gateway.signatures import ReasoningCodec


class ResponsesEventWriter:
    """Numbers and frames Responses stream events."""

    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        payload: dict[str, Any] = {"type": kind, "sequence_number": self.seq}
        payload.update(fields)
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def lifecycle(self, kind: str, response: dict[str, Any]) -> bytes:
        """response.created / in_progress / completed / incomplete / failed."""
        return self.event(kind, response=response)

    def item_added(self, index: int, item: dict[str, Any]) -> bytes:
        return self.event("response.output_item.added", output_index=index, item=item)

    def item_done(self, index: int, item: dict[str, Any]) -> bytes:
        return self.event("response.output_item.done", output_index=index, item=item)

    def summary_part(self, kind: str, index: int, item_id: str, text: str) -> bytes:
        """reasoning_summary_part.added (text "") or .done (full text), summary part 0."""
        part = {"type": "summary_text", "text": text}
        return self.event(kind, item_id=item_id, output_index=index, summary_index=0, part=part)

    def summary_delta(self, index: int, item_id: str, delta: str) -> bytes:
        return self.event(
            "response.reasoning_summary_text.delta",
            item_id=item_id,
            output_index=index,
            summary_index=0,
            delta=delta,
        )

    def summary_done(self, index: int, item_id: str, text: str) -> bytes:
        return self.event(
            "response.reasoning_summary_text.done",
            item_id=item_id,
            output_index=index,
            summary_index=0,
            text=text,
        )

    def text_part(self, kind: str, index: int, item_id: str, text: str) -> bytes:
        """content_part.added (text "") or content_part.done (full text), content part 0."""
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return self.event(kind, item_id=item_id, output_index=index, content_index=0, part=part)

    def text_delta(self, index: int, item_id: str, delta: str) -> bytes:
        return self.event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def text_done(self, index: int, item_id: str, text: str) -> bytes:
        return self.event(
            "response.output_text.done",
            item_id=item_id,
            output_index=index,
            content_index=0,
            text=text,
            logprobs=[],
        )

    def arguments_delta(self, index: int, item_id: str, delta: str) -> bytes:
        return self.event(
            "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=delta
        )

    def arguments_done(self, index: int, item_id: str, name: str, arguments: str) -> bytes:
        return self.event(
            "response.function_call_arguments.done",
            item_id=item_id,
            output_index=index,
            name=name,
            arguments=arguments,
        )

    def input_delta(self, index: int, item_id: str, call_id: str, delta: str) -> bytes:
        return self.event(
            "response.custom_tool_call_input.delta",
            item_id=item_id,
            call_id=call_id,
            output_index=index,
            delta=delta,
        )

    def input_done(self, index: int, item_id: str, call_id: str, text: str) -> bytes:
        return self.event(
            "response.custom_tool_call_input.done",
            item_id=item_id,
            call_id=call_id,
            output_index=index,
            input=text,
        )

    def failed(self, error: dict[str, Any], response_id: str | None = None, model: str = "") -> bytes:
        """An in-stream failure, understood by both kinds of client.

        1. `error`: the fields flat (as OpenAI's reference documents) and nested under `error` (as the live
           API sends them, openai-dotnet#881); the nested key makes the openai SDK raise `APIError`.
        2. `response.failed` with `response.error {code, message}`: what Codex acts on
           (codex-rs `process_sse`: `context_length_exceeded` -> context window exceeded, others retried).
        """
        code = error.get("code") or "server_error"  # ResponseError.code is required
        first = self.event(
            "error", code=code, message=error["message"], param=error.get("param"), error=error
        )
        resp = {
            "id": response_id or f"resp_failed_{self.seq}_{unix_now()}",
            "object": "response",
            "created_at": unix_now(),
            "status": "failed",
            "error": {"code": code, "message": error["message"]},
            "incomplete_details": None,
            "model": model,
            "output": [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
        return first + self.lifecycle("response.failed", resp)


def synthesize(req: CanonicalRequest, comp: Completion, codec: ReasoningCodec) -> Iterator[bytes]:
    """The full event stream of one finished completion."""
    w = ResponsesEventWriter()
    resp_id = f"resp_{base_id(comp)}"
    created = comp.created or unix_now()
    items = output_items(req, comp, codec)
    opening = response_object(req, resp_id, created, status="in_progress", output=[])
    yield w.lifecycle("response.created", opening)
    yield w.lifecycle("response.in_progress", opening)
    for index, out in enumerate(items):
        yield from _item_events(w, index, out)
    status, reason = final_status(comp)
    final = response_object(
        req,
        resp_id,
        created,
        status=status,
        output=[o.item for o in items],
        usage=usage(comp),
        incomplete_reason=reason,
    )
    yield w.lifecycle(f"response.{status}", final)


def _item_events(w: ResponsesEventWriter, index: int, out: OutputItem) -> Iterator[bytes]:
    item = out.item
    item_id = item["id"]
    if out.kind == "reasoning":
        yield w.item_added(index, {"id": item_id, "type": "reasoning", "summary": []})
        yield w.summary_part("response.reasoning_summary_part.added", index, item_id, "")
        for piece in split_text(out.text):
            yield w.summary_delta(index, item_id, piece)
        yield w.summary_done(index, item_id, out.text)
        yield w.summary_part("response.reasoning_summary_part.done", index, item_id, out.text)
    elif out.kind == "message":
        yield w.item_added(index, {**item, "status": "in_progress", "content": []})
        yield w.text_part("response.content_part.added", index, item_id, "")
        for piece in split_text(out.text):
            if piece:
                yield w.text_delta(index, item_id, piece)
        yield w.text_done(index, item_id, out.text)
        yield w.text_part("response.content_part.done", index, item_id, out.text)
    elif out.kind == "function_call":
        yield w.item_added(index, {**item, "status": "in_progress", "arguments": ""})
        for piece in split_text(out.text, parts=3):
            if piece:
                yield w.arguments_delta(index, item_id, piece)
        yield w.arguments_done(index, item_id, item["name"], out.text)
    else:
        yield w.item_added(index, {**item, "status": "in_progress", "input": ""})
        for piece in split_text(out.text, parts=3):
            if piece:
                yield w.input_delta(index, item_id, item["call_id"], piece)
        yield w.input_done(index, item_id, item["call_id"], out.text)
    yield w.item_done(index, item)
