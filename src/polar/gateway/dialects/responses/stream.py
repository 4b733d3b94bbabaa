"""The Responses streaming grammar: `event:` + `data:` frames numbered by `sequence_number`.

`ResponsesEventWriter` has one method per event kind; `ResponsesStreamEncoder` drives it token by token from a
streamed upstream, `synthesize` from one finished `Completion`, the way OpenAI would have streamed it:

    response.created, response.in_progress,
    per output item: response.output_item.added,
        reasoning: reasoning_summary_part.added, reasoning_summary_text.delta*, .done, summary_part.done
        message:   content_part.added, output_text.delta*, output_text.done, content_part.done
        function:  function_call_arguments.delta*, function_call_arguments.done
        custom:    custom_tool_call_input.delta*, custom_tool_call_input.done
        tool search call: nothing between (its `arguments` is an object)
    response.output_item.done, ...,
    response.completed (or response.incomplete when the policy hit max_output_tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from polar.gateway.canonical import CanonicalRequest, Completion, StreamChunk, StreamHead, ToolCallDelta
from polar.gateway.dialects.openai_wire import split_text, unix_now
from polar.gateway.dialects.responses.render import (
    OutputItem,
    base_id,
    call_item,
    custom_input,
    error_body,
    final_status,
    output_items,
    response_object,
    search_arguments,
    search_item,
    strip_id,
    usage,
)
from polar.gateway.dialects.responses.tools import SEARCH
from polar.gateway.errors import GatewayError
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
    elif out.kind == "tool_search_call":
        yield w.item_added(index, item)  # no deltas: `arguments` is an object, whole or not at all
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


_CALLS = ("function_call", "custom_tool_call", "tool_search_call")


class ResponsesStreamEncoder:
    """A Responses stream as it is sampled (a `StreamEncoder`).

    Output items open in the order their pieces arrive (vLLM: reasoning, message, tool calls), each closed
    (its `.done` events) when a piece of another item arrives or at `close`:
    - reasoning: summary text deltas as they come; the item's `encrypted_content` (our codec token) on its
      `output_item.done`, since it signs the whole reasoning;
    - message: `output_text` deltas as they come; a message still open at `close` is `incomplete` when the
      policy hit its token limit;
    - function call: argument deltas as they come;
    - custom tool call: held back and sent whole when the call is complete, because its `input` is the
      string inside the model's `{"input": ...}` arguments (`custom_input`), known only from the whole text;
    - tool search call: held back entirely (even its `output_item.added`): whether the arguments parse to
      the object a `tool_search_call` carries, or the call goes back as a `function_call`, is known only then.
    `close` adds the empty message a Responses answer has when the policy said nothing and called nothing,
    then `response.completed` (or `incomplete`) with every item and the usage.
    """

    def __init__(self, req: CanonicalRequest, codec: ReasoningCodec) -> None:
        self._req = req
        self._codec = codec
        self._w = ResponsesEventWriter()
        self._base = ""
        self._resp_id = ""
        self._created = 0
        self._items: list[dict[str, Any]] = []  # finished items, in output order
        self._kind: str | None = None  # kind of the open item
        self._item: dict[str, Any] = {}
        self._parts: list[str] = []
        self._tool_index = -1
        self._has_answer = False  # a message or a tool call was written
        self._custom: frozenset[str] = req.render.get("custom_tools") or frozenset()

    def open(self, head: StreamHead) -> bytes:
        self._base = strip_id(head.id)
        self._resp_id = f"resp_{self._base}"
        self._created = head.created or unix_now()
        opening = response_object(self._req, self._resp_id, self._created, status="in_progress", output=[])
        return self._w.lifecycle("response.created", opening) + self._w.lifecycle(
            "response.in_progress", opening
        )

    def delta(self, chunk: StreamChunk) -> bytes:
        out = b""
        w = self._w
        if chunk.reasoning:
            if self._kind != "reasoning":
                item_id = self._next_id("rs")
                out += self._begin("reasoning", {"id": item_id, "type": "reasoning", "summary": []})
                out += w.summary_part("response.reasoning_summary_part.added", self._index, item_id, "")
            out += w.summary_delta(self._index, self._item["id"], chunk.reasoning)
            self._parts.append(chunk.reasoning)
        if chunk.content:
            if self._kind != "message":
                out += self._open_message()
            out += w.text_delta(self._index, self._item["id"], chunk.content)
            self._parts.append(chunk.content)
        for tc in chunk.tool_calls:
            if tc.index != self._tool_index or self._kind not in _CALLS:
                out += self._begin_call(tc)
            if tc.arguments:
                self._parts.append(tc.arguments)
                if self._kind == "function_call":
                    out += w.arguments_delta(self._index, self._item["id"], tc.arguments)
        return out

    @property
    def _index(self) -> int:
        return len(self._items)

    def _next_id(self, prefix: str) -> str:
        n = sum(1 for i in self._items if i["id"].startswith(f"{prefix}_"))
        return f"{prefix}_{self._base}" if n == 0 else f"{prefix}_{self._base}_{n}"

    def _begin(self, kind: str, item: dict[str, Any]) -> bytes:
        out = self._end()
        self._kind, self._item, self._parts = kind, item, []
        return out + self._w.item_added(self._index, item)

    def _begin_call(self, tc: ToolCallDelta) -> bytes:
        self._tool_index = tc.index
        name = tc.name or ""
        if name == SEARCH and self._req.render.get("tool_search"):
            out = self._end()
            head = {"id": f"tsc_{self._base}_{tc.index}", "call_id": tc.call_id}
            self._kind, self._item, self._parts = "tool_search_call", head, []
            return out
        if name in self._custom:
            item = call_item(self._req, "custom_tool_call", f"ctc_{self._base}_{tc.index}", tc.call_id, name)
            return self._begin("custom_tool_call", {**item, "status": "in_progress", "input": ""})
        item = call_item(self._req, "function_call", f"fc_{self._base}_{tc.index}", tc.call_id, name)
        return self._begin("function_call", {**item, "status": "in_progress", "arguments": ""})

    def _end(self, truncated: bool = False) -> bytes:
        """The `.done` events of the open item, which joins the finished ones."""
        kind, item, w, index = self._kind, self._item, self._w, self._index
        if kind is None:
            return b""
        text = "".join(self._parts)
        item_id = item["id"]
        self._kind = None
        if kind == "reasoning":
            done: dict[str, Any] = {**item, "summary": [{"type": "summary_text", "text": text}]}
            if self._req.render.get("include_encrypted"):
                done["encrypted_content"] = self._codec.encode(text)
            out = w.summary_done(index, item_id, text)
            out += w.summary_part("response.reasoning_summary_part.done", index, item_id, text)
        elif kind == "message":
            self._has_answer = True
            content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            done = {**item, "status": "incomplete" if truncated else "completed", "content": content}
            out = w.text_done(index, item_id, text)
            out += w.text_part("response.content_part.done", index, item_id, text)
        elif kind == "function_call":
            self._has_answer = True
            done = {**item, "status": "completed", "arguments": text}
            out = w.arguments_done(index, item_id, item["name"], text)
        elif kind == "tool_search_call":
            self._has_answer = True
            searched = search_arguments(self._req, SEARCH, text)
            if searched is not None:
                done = search_item(item_id, item["call_id"], searched)
                out = w.item_added(index, done)
            else:  # not an object: a plain function call, as `output_items` answers it
                # The id from the item's own (`tsc_<base>_<index>`): a next call may have moved _tool_index on.
                head = call_item(self._req, "function_call", "fc_" + item_id[4:], item["call_id"], SEARCH)
                done = {**head, "arguments": text}
                out = w.item_added(index, {**head, "status": "in_progress", "arguments": ""})
                out += w.arguments_delta(index, head["id"], text) if text else b""
                out += w.arguments_done(index, head["id"], SEARCH, text)
        else:
            self._has_answer = True
            value = custom_input(text)
            done = {**item, "status": "completed", "input": value}
            out = w.input_delta(index, item_id, item["call_id"], value) if value else b""
            out += w.input_done(index, item_id, item["call_id"], value)
        self._items.append(done)
        return out + w.item_done(index, done)

    def _open_message(self) -> bytes:
        """A new output message item and its first (empty) text part."""
        item_id = self._next_id("msg")
        item = {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        out = self._begin("message", item)
        return out + self._w.text_part("response.content_part.added", self._index, item_id, "")

    def close(self, comp: Completion) -> bytes:
        status, reason = final_status(comp)
        out = self._end(truncated=reason is not None)
        if not self._has_answer:  # an answer always has a message, empty when the policy said nothing
            out += self._open_message()
            out += self._end(truncated=reason is not None)
        final = response_object(
            self._req,
            self._resp_id,
            self._created,
            status=status,
            output=self._items,
            usage=usage(comp),
            incomplete_reason=reason,
        )
        return out + self._w.lifecycle(f"response.{status}", final)

    def fail(self, err: GatewayError) -> bytes:
        return self._w.failed(
            error_body(err), self._resp_id or None, self._req.render.get("model", self._req.model)
        )
