"""Gemini request bodies to Chat messages.

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

from polar.gateway.canonical import CanonicalRequest
from polar.gateway.dialects import gemini_schema as g
from polar.gateway.dialects.wire import data_url, parse_model, tool_arguments
from polar.gateway.errors import invalid
from polar.gateway.signatures import ReasoningCodec

_UNSUPPORTED_PARTS = (
    ("file_data", "fileData"),
    ("executable_code", "executableCode"),
    ("code_execution_result", "codeExecutionResult"),
)


def parse_request(
    body: Any, codec: ReasoningCodec, path_model: str | None, path_stream: bool | None
) -> CanonicalRequest:
    """Validate a `generateContent` body and normalize it; the model and streaming come from the path."""
    if not path_model:
        raise invalid("the model must be given in the path: /v1beta/models/{model}:generateContent", "model")
    req = parse_model(g.GenerateContentRequest, body)
    render: dict[str, Any] = {}
    messages: list[dict[str, Any]] = []
    if req.system_instruction is not None:
        system = _system_text(req.system_instruction)
        if system:
            messages.append({"role": "system", "content": system})
    _Turns(codec, messages).convert(req.contents)

    tools, names, dropped = _tools(req.tools)
    if dropped:
        render["dropped_tools"] = dropped
    tool_choice = None
    cfg = req.tool_config.function_calling_config if req.tool_config else None
    if cfg is not None:
        tool_choice, tools = _tool_choice(cfg, tools, names)

    params: dict[str, Any] = {}
    if req.generation_config is not None:
        _generation(req.generation_config, params, render)
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


def _system_text(content: g.Content) -> str:
    return "\n".join(p.text for p in content.parts if p.text is not None and not p.thought)


class _Turns:
    """Walks `contents` in order, pairing function responses with the calls they answer."""

    def __init__(self, codec: ReasoningCodec, out: list[dict[str, Any]]) -> None:
        self.codec = codec
        self.out = out
        self.known: set[str] = set()
        self.pending: dict[str, deque[str]] = {}

    def convert(self, contents: list[g.Content]) -> None:
        for i, content in enumerate(contents):
            for j, part in enumerate(content.parts):
                for field, wire in _UNSUPPORTED_PARTS:
                    if getattr(part, field) is not None:
                        path = f"contents[{i}].parts[{j}].{wire}"
                        raise invalid(f"unsupported part {path}: the policy cannot read it", path)
            if content.role == "model":
                self.out.append(self._model(content, i))
            else:
                self._user(content, i)

    def _model(self, content: g.Content, i: int) -> dict[str, Any]:
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        restored: str | None = None
        for j, part in enumerate(content.parts):
            if restored is None and part.thought_signature:
                restored = decode_signature(self.codec, part.thought_signature)
            if part.function_call is not None:
                fc = part.function_call
                call_id = fc.id or f"call_{i}_{j}"
                self.known.add(call_id)
                self.pending.setdefault(fc.name, deque()).append(call_id)
                fn = {"name": fc.name, "arguments": tool_arguments(fc.args or {})}
                calls.append({"id": call_id, "type": "function", "function": fn})
            elif part.text is not None:
                (thoughts if part.thought else texts).append(part.text)
            elif part.function_response is not None or part.inline_data is not None:
                kind = "functionResponse" if part.function_response is not None else "inlineData"
                path = f"contents[{i}].parts[{j}].{kind}"
                raise invalid(f"{path}: a model turn cannot carry a {kind} part", path)
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
        for j, part in enumerate(content.parts):
            if part.function_response is not None:
                self.out.append(self._tool_message(part.function_response, parts))
            elif part.inline_data is not None:
                parts.append(_image(part.inline_data))
            elif part.text is not None and not part.thought:
                parts.append({"type": "text", "text": part.text})
            elif part.function_call is not None:
                path = f"contents[{i}].parts[{j}].functionCall"
                raise invalid(f"{path}: only a model turn can carry a functionCall part", path)
        if parts:
            self.out.append({"role": "user", "content": parts})

    def _tool_message(self, fr: g.FunctionResponse, images: list[dict[str, Any]]) -> dict[str, Any]:
        queue = self.pending.get(fr.name)
        if fr.id is not None and fr.id in self.known:
            call_id = fr.id
            if queue and call_id in queue:
                queue.remove(call_id)
        elif queue:
            call_id = queue.popleft()
        else:
            call_id = fr.id or f"call_{fr.name}"
        for extra in fr.parts or ():
            if extra.inline_data is not None:
                images.append(_image(extra.inline_data))
        return {"role": "tool", "tool_call_id": call_id, "content": _response_text(fr.response)}


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
    return {"type": "image_url", "image_url": {"url": data_url(blob.mime_type, blob.data)}}


def _tools(tools: list[g.Tool] | None) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    out: list[dict[str, Any]] = []
    names: list[str] = []
    dropped: list[str] = []
    for tool in tools or ():
        # googleSearch, codeExecution, urlContext, retrieval...: run by Google, not by the policy.
        dropped.extend(tool.model_extra or ())
        for decl in tool.function_declarations or ():
            fn: dict[str, Any] = {"name": decl.name}
            if decl.description is not None:
                fn["description"] = decl.description
            if decl.parameters_json_schema is not None:
                fn["parameters"] = decl.parameters_json_schema
            elif decl.parameters is not None:
                fn["parameters"] = g.to_json_schema(decl.parameters)
            out.append({"type": "function", "function": fn})
            names.append(decl.name)
    return out, names, dropped


def _tool_choice(
    cfg: g.FunctionCallingConfig, tools: list[dict[str, Any]], names: list[str]
) -> tuple[Any, list[dict[str, Any]]]:
    if cfg.mode == "NONE":
        return "none", tools
    if cfg.mode != "ANY":
        return ("auto" if cfg.mode in ("AUTO", "VALIDATED") else None), tools
    allowed = cfg.allowed_function_names
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
    if cfg.candidate_count is not None and cfg.candidate_count != 1:
        raise invalid(
            "generationConfig.candidateCount: only 1 candidate is supported",
            "generationConfig.candidateCount",
        )
    for key, value in (
        ("temperature", cfg.temperature),
        ("top_p", cfg.top_p),
        ("top_k", cfg.top_k),
        ("max_tokens", cfg.max_output_tokens),
        ("seed", cfg.seed),
        ("presence_penalty", cfg.presence_penalty),
        ("frequency_penalty", cfg.frequency_penalty),
    ):
        if value is not None:
            params[key] = value
    if cfg.stop_sequences:
        params["stop"] = cfg.stop_sequences
    mime = cfg.response_mime_type
    if mime == "application/json":
        schema = cfg.response_json_schema
        if schema is None and cfg.response_schema is not None:
            schema = g.to_json_schema(cfg.response_schema)
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
    tc = cfg.thinking_config
    if tc is not None:
        if tc.include_thoughts:
            render["include_thoughts"] = True
        if tc.thinking_budget == 0:
            params["chat_template_kwargs"] = {"enable_thinking": False}
            render["thinking"] = False
        elif tc.thinking_budget is not None or tc.thinking_level is not None:
            params["chat_template_kwargs"] = {"enable_thinking": True}
            render["thinking"] = True
