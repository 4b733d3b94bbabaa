r"""Gemini request bodies to Chat messages.

Conversion choices (deterministic, so the same history always yields the same upstream prompt):
- `systemInstruction` text parts are joined with "\n" into one system message.
- A user turn's `functionResponse` parts become `tool` messages, in order, followed by one user message with
  its text and `inlineData` parts. A response `{"output": s}` (Gemini CLI's shape) reaches the model as `s`,
  `{"error": s}` as "Error: " + s, anything else as compact JSON.
- Function calls without an `id` get `call_<turn>_<part>`; a `functionResponse` is matched to its call by
  id, else to the oldest unanswered call of the same name.
- Reasoning of a model turn: the text our own `thoughtSignature` carries when one verifies, else the text of
  its thought parts.
- Our `thoughtSignature` is base64 of the codec token: the SDKs type it as bytes and reject anything else.
- `toolConfig` mode ANY with several `allowedFunctionNames`: Chat has no allow-list, so the policy is shown
  only the allowed declarations and must call one of them.
"""

from __future__ import annotations

import base64
import binascii
from collections import deque
from typing import Any

import orjson

from polar.gateway.canonical import UNNAMED_CALL_PREFIX, CanonicalRequest
from polar.gateway.dialects.gemini import schema as g
from polar.gateway.dialects.tool_schema import check_tool_schema
from polar.gateway.dialects.validation import validate
from polar.gateway.dialects.wire import PLAIN_STYLE, SignatureCache, data_url, tool_arguments
from polar.gateway.errors import invalid
from polar.gateway.signatures import ReasoningCodec
from polar.jsontypes import JSON

_UNSUPPORTED_PARTS = (
    ("file_data", "fileData"),
    ("executable_code", "executableCode"),
    ("code_execution_result", "codeExecutionResult"),
)


def parse_request(
    body: JSON, codec: ReasoningCodec, path_model: str | None, path_stream: bool | None
) -> CanonicalRequest:
    """Validate a `generateContent` body and normalize it; the model and streaming come from the path."""
    if not path_model:
        raise invalid(
            "the model must be given in the path: /v1beta/models/{model}:generateContent (or /v1/...)",
            "model",
        )
    req = validate(g.GENERATE_CONTENT_REQUEST, body, PLAIN_STYLE)
    render: dict[str, Any] = {}
    messages: list[dict[str, Any]] = []
    if (instruction := req.get("system_instruction")) is not None:
        system = _system_text(instruction)
        if system:
            messages.append({"role": "system", "content": system})
    _Turns(codec, messages).convert(req["contents"])

    tools, names, dropped = _tools(req.get("tools"))
    if dropped:
        render["dropped_tools"] = dropped
    tool_choice = None
    tool_config = req.get("tool_config")
    cfg = tool_config.get("function_calling_config") if tool_config else None
    if cfg is not None:
        tool_choice, tools = _tool_choice(cfg, tools, names)

    params: dict[str, Any] = {}
    if (generation := req.get("generation_config")) is not None:
        _generation(generation, params, render)
    return CanonicalRequest(
        model=path_model,
        messages=messages,
        tools=tools or None,
        tool_choice=tool_choice,
        params=params,
        stream=bool(path_stream),
        render=render,
    )


# ---- signatures -------------------------------------------------------------------------------------


def encode_signature(codec: ReasoningCodec, reasoning: str) -> str:
    return base64.b64encode(codec.encode(reasoning).encode()).decode()


def decode_signature(codec: ReasoningCodec, signature: str | None) -> str | None:
    """The reasoning a `thoughtSignature` carries, whichever base64 alphabet the client re-encoded it in
    (the Python SDK sends bytes back urlsafe), or None when it is not ours."""
    if not signature:
        return None
    try:
        raw = base64.b64decode(signature.translate(_URLSAFE) + "=" * (-len(signature) % 4), validate=True)
        token = raw.decode("ascii")
    except (binascii.Error, ValueError):
        return codec.decode(signature)
    return codec.decode(token)


_URLSAFE = str.maketrans("-_", "+/")
_restore = SignatureCache(decode_signature)


def _system_text(content: g.Content) -> str:
    texts = (p.get("text") for p in content.get("parts", ()) if not p.get("thought"))
    return "\n".join(t for t in texts if t is not None)


class _Turns:
    """Walks `contents` in order, pairing function responses with the calls they answer."""

    def __init__(self, codec: ReasoningCodec, out: list[dict[str, Any]]) -> None:
        self.codec = codec
        self.out = out
        self.known: set[str] = set()
        self.pending: dict[str, deque[str]] = {}

    def convert(self, contents: list[g.Content]) -> None:
        for i, content in enumerate(contents):
            if content.get("role") == "model":
                self.out.append(self._model(content, i))
            else:
                self._user(content, i)

    def _model(self, content: g.Content, i: int) -> dict[str, Any]:
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        restored: str | None = None
        for j, part in enumerate(content.get("parts", ())):
            if restored is None and (signature := part.get("thought_signature")):
                restored = _restore(self.codec, signature)
            if (fc := part.get("function_call")) is not None:
                call_id = fc.get("id") or f"{UNNAMED_CALL_PREFIX}{i}_{j}"
                self.known.add(call_id)
                self.pending.setdefault(fc["name"], deque()).append(call_id)
                fn = {"name": fc["name"], "arguments": tool_arguments(fc.get("args") or {})}
                calls.append({"id": call_id, "type": "function", "function": fn})
            elif (text := part.get("text")) is not None:
                (thoughts if part.get("thought") else texts).append(text)
            elif part.get("function_response") is not None or part.get("inline_data") is not None:
                kind = "functionResponse" if part.get("function_response") is not None else "inlineData"
                path = f"contents[{i}].parts[{j}].{kind}"
                raise invalid(f"{path}: a model turn cannot carry a {kind} part", path)
            else:
                _refuse_unsupported(part, i, j)
        text = "".join(texts)
        msg: dict[str, Any] = {"role": "assistant", "content": text if texts or not calls else None}
        reasoning = restored if restored is not None else ("".join(thoughts) if thoughts else None)
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg

    def _user(self, content: g.Content, i: int) -> None:
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content.get("parts", ())):
            if (fr := part.get("function_response")) is not None:
                self.out.append(self._tool_message(fr, parts))
            elif (blob := part.get("inline_data")) is not None:
                parts.append(_image(blob))
            elif (text := part.get("text")) is not None and not part.get("thought"):
                parts.append({"type": "text", "text": text})
            elif part.get("function_call") is not None:
                path = f"contents[{i}].parts[{j}].functionCall"
                raise invalid(f"{path}: only a model turn can carry a functionCall part", path)
            else:
                _refuse_unsupported(part, i, j)
        if parts:
            self.out.append({"role": "user", "content": parts})

    def _tool_message(self, fr: g.FunctionResponse, images: list[dict[str, Any]]) -> dict[str, Any]:
        name = fr["name"]
        given = fr.get("id")
        queue = self.pending.get(name)
        if given is not None and given in self.known:
            call_id = given
            if queue and call_id in queue:
                queue.remove(call_id)
        elif queue:
            call_id = queue.popleft()
        else:
            call_id = given or f"call_{name}"
        for extra in fr.get("parts") or ():
            if (blob := extra.get("inline_data")) is not None:
                images.append(_image(blob))
        return {"role": "tool", "tool_call_id": call_id, "content": _response_text(fr.get("response"))}


def _refuse_unsupported(part: g.Part, i: int, j: int) -> None:
    """A part with none of the kinds we convert: refused by name if it holds content we cannot pass on
    (a bare `thoughtSignature` or an empty part is simply skipped)."""
    for key, wire in _UNSUPPORTED_PARTS:
        if part.get(key) is not None:
            path = f"contents[{i}].parts[{j}].{wire}"
            raise invalid(f"unsupported part {path}: the policy cannot read it", path)


def _response_text(response: dict[str, Any] | None) -> str:
    if not response:
        return ""
    if len(response) == 1:
        if isinstance(output := response.get("output"), str):
            return output
        if isinstance(error := response.get("error"), str):
            return f"Error: {error}"
    return orjson.dumps(response).decode()


def _image(blob: g.Blob) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(blob["mime_type"], blob["data"])}}


def _tools(tools: list[g.Tool] | None) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    out: list[dict[str, Any]] = []
    names: list[str] = []
    dropped: list[str] = []
    for i, tool in enumerate(tools or ()):
        # googleSearch, codeExecution, urlContext, retrieval...: run by Google, not by the policy.
        dropped.extend(k for k in tool if k != "function_declarations")
        for j, decl in enumerate(tool.get("function_declarations") or ()):
            fn: dict[str, Any] = {"name": decl["name"]}
            where = f"tools[{i}].functionDeclarations[{j}]"
            if (description := decl.get("description")) is not None:
                fn["description"] = description
            if (json_schema := decl.get("parameters_json_schema")) is not None:
                check_tool_schema(json_schema, where, decl["name"], "parametersJsonSchema")
                fn["parameters"] = json_schema
            elif (openapi := decl.get("parameters")) is not None:
                # Gemini's OpenAPI-style Schema is checked as the JSON Schema it becomes upstream.
                fn["parameters"] = g.to_json_schema(openapi)
                check_tool_schema(fn["parameters"], where, decl["name"], "parameters")
            out.append({"type": "function", "function": fn})
            names.append(decl["name"])
    return out, names, dropped


def _tool_choice(
    cfg: g.FunctionCallingConfig, tools: list[dict[str, Any]], names: list[str]
) -> tuple[Any, list[dict[str, Any]]]:
    mode = cfg.get("mode")
    if mode == "NONE":
        return "none", tools
    if mode != "ANY":
        return ("auto" if mode in ("AUTO", "VALIDATED") else None), tools
    allowed = cfg.get("allowed_function_names")
    if not allowed:
        return "required", tools
    for k, name in enumerate(allowed):
        if name not in names:
            path = f"toolConfig.functionCallingConfig.allowedFunctionNames[{k}]"
            raise invalid(f"{path}: {name!r} is not a declared function", path)
    if len(allowed) == 1:
        return {"type": "function", "function": {"name": allowed[0]}}, tools
    # Chat has no allow-list: the policy is shown only the allowed declarations and must call one.
    keep = set(allowed)
    return "required", [t for t in tools if t["function"]["name"] in keep]


def _generation(cfg: g.GenerationConfig, params: dict[str, Any], render: dict[str, Any]) -> None:
    if cfg.get("candidate_count") not in (None, 1):
        raise invalid(
            "generationConfig.candidateCount: only 1 candidate is supported",
            "generationConfig.candidateCount",
        )
    for key, wire in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("max_tokens", "max_output_tokens"),
        ("seed", "seed"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    ):
        if (value := cfg.get(wire)) is not None:
            params[key] = value
    if stop := cfg.get("stop_sequences"):
        params["stop"] = stop
    mime = cfg.get("response_mime_type")
    if mime == "application/json":
        schema = cfg.get("response_json_schema")
        if schema is None and (openapi := cfg.get("response_schema")) is not None:
            schema = g.to_json_schema(openapi)
        params["response_format"] = (
            {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
            if schema is not None
            else {"type": "json_object"}
        )
    elif mime not in (None, "text/plain"):
        raise invalid(
            f"generationConfig.responseMimeType {mime!r} is not supported",
            "generationConfig.responseMimeType",
        )
    tc = cfg.get("thinking_config")
    if tc is not None:
        if tc.get("include_thoughts"):
            render["include_thoughts"] = True
        budget = tc.get("thinking_budget")
        if budget == 0:
            params["chat_template_kwargs"] = {"enable_thinking": False}
            render["thinking"] = False
        elif budget is not None or tc.get("thinking_level") is not None:
            params["chat_template_kwargs"] = {"enable_thinking": True}
            render["thinking"] = True
