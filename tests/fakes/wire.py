"""Response and error bodies in the exact wire shapes of vLLM, SGLang and a plain OpenAI endpoint.

Used by the fake inference server; the shapes follow vLLM's `ChatCompletionResponse` (top-level
`prompt_token_ids`, per-choice `token_ids`, `logprobs.content`, `message.reasoning`), SGLang's
`ChatCompletionResponseChoice` (per-choice `prompt_token_ids` and `meta_info.output_token_logprobs` as
`[logprob, token_id, text]`, `metadata.weight_version`) and OpenAI's error envelope.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from tests.fakes.chatml import FakeTokenizer, logprob

Sampled = dict[str, Any]  # what the fake generated: message parts, ids, finish reason (see fake_vllm)


def error_body(kind: str, status: int, message: str, err_type: str | None = None) -> dict[str, Any]:
    """vLLM (nested `error`), SGLang (flat, `object: error`) or OpenAI (nested, string type) error body."""
    if err_type is None:
        phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
        err_type = phrase if phrase.endswith("Error") else phrase + "Error"
    if kind == "sglang":
        return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    if kind == "openai":
        code = "context_length_exceeded" if "context length" in message else None
        oa_type = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": oa_type, "param": None, "code": code}}
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


def overflow_message(kind: str, max_model_len: int, prompt_len: int, max_tokens: int | None) -> str:
    """The context-overflow wording of each server (vLLM 0.11's two checks, SGLang's, OpenAI's)."""
    if kind == "sglang":
        if prompt_len > max_model_len or max_tokens is None:
            return f"The input ({prompt_len} tokens) is longer than the model's context length ({max_model_len} tokens)."
        return (
            f"Requested token count exceeds the model's maximum context length of {max_model_len} tokens. "
            f"You requested a total of {prompt_len + max_tokens} tokens: {prompt_len} tokens from the input "
            f"messages and {max_tokens} tokens for the completion. Please reduce the number of tokens in the "
            "input messages or the completion to fit within the limit."
        )
    if kind == "openai":
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, your messages resulted in "
            f"{prompt_len} tokens. Please reduce the length of the messages."
        )
    if prompt_len > max_model_len or max_tokens is None:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages."
        )
    return (
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
        f"length is {max_model_len} tokens and your request has {prompt_len} input tokens "
        f"({max_tokens} > {max_model_len} - {prompt_len})."
    )


def vllm_032_context_check(
    max_model_len: int, prompt_len: int, max_tokens: int | None, param: str
) -> tuple[str | None, int]:
    """vLLM 0.32's own checks (renderers/params.py `TokenizeParams`, v1/engine/input_processor.py, and
    `get_max_tokens` in entrypoints/serve/utils/api_utils.py): (the 400's message or None, the max_tokens it
    samples with). Unlike 0.11 it refuses only `max_tokens` above the whole context or a prompt that leaves
    no room; a prompt plus `max_tokens` over the context is sampled with `max_tokens` cut to what fits."""
    if max_tokens is not None and max_tokens > max_model_len:
        return (
            f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter={param}, value={max_tokens})"
        ), 0
    if prompt_len > max_model_len:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            f"the length of the input prompt. (parameter=input_tokens, value={prompt_len})"
        ), 0
    if prompt_len == max_model_len:
        return (
            f"The decoder prompt (length {prompt_len}) plus the number of requested output tokens (at least 1) "
            f"is longer than the maximum model length of {max_model_len}. Make sure that `max_model_len` is no "
            "smaller than the number of text tokens (prompt + requested output tokens)."
        ), 0
    room = max_model_len - prompt_len
    return None, room if max_tokens is None else min(max_tokens, room)


def _tool_calls(s: Sampled) -> list[dict[str, Any]]:
    return [
        {"id": f"call_{s['seq']}_{j}", "type": "function", "function": {"name": name, "arguments": args}}
        for j, (name, args) in enumerate(s["tool_calls"])
    ]


def _logprob_content(tok: FakeTokenizer, ids: list[int]) -> list[dict[str, Any]]:
    out = []
    for pos, i in enumerate(ids):
        text, raw = tok.token_info(i)
        out.append({"token": text, "logprob": logprob(pos, i), "bytes": raw, "top_logprobs": []})
    return out


def _envelope(
    id_: str,
    obj: str,
    seq: int,
    req: dict[str, Any],
    choice: dict[str, Any],
    prompt: list[int],
    ids: list[int],
) -> dict[str, Any]:
    """What a completion body and a chat completion body share: id, object, created, model, the one choice
    and the usage counts."""
    return {
        "id": id_,
        "object": obj,
        "created": 1_700_000_000 + seq,
        "model": req.get("model") or "fake-model",
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        },
    }


def completions_body(
    seq: int, ids: list[int], prompt: list[int], finish: str, req: dict[str, Any], version: int | None
) -> dict[str, Any]:
    """vLLM 0.32's `/v1/completions` body for a prompt of ids and the sampled `ids` (`return_token_ids`:
    the ids on the choice; `logprobs`: the legacy per-token lists)."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    if req.get("logprobs") is not None:
        choice["logprobs"] = {
            "text_offset": [0] * len(ids),
            "token_logprobs": [logprob(pos, i) for pos, i in enumerate(ids)],
            "tokens": [f"token_id:{i}" for i in ids],
            "top_logprobs": [{} for _ in ids],
        }
    if req.get("return_token_ids"):
        choice["token_ids"] = ids
        choice["prompt_token_ids"] = prompt
    body = _envelope(f"cmpl-fake-{seq}", "text_completion", seq, req, choice, prompt, ids)
    if version is not None:
        body["policy_version"] = version
    return body


def chat_body(
    kind: str, s: Sampled, req: dict[str, Any], tok: FakeTokenizer, with_tokens: bool
) -> dict[str, Any]:
    """The chat completion body of `kind` for the sampled turn `s`."""
    ids: list[int] = s["ids"]
    prompt: list[int] = s["prompt_ids"]
    message: dict[str, Any] = {"role": "assistant", "content": s["content"] or None}
    calls = _tool_calls(s)
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": s["finish"]}
    body = _envelope(f"chatcmpl-fake-{s['seq']}", "chat.completion", s["seq"], req, choice, prompt, ids)
    if kind == "vllm":
        if s["reasoning"] is not None:
            message["reasoning"] = s["reasoning"]
        if calls:
            message["tool_calls"] = calls
        choice["stop_reason"] = None
        if with_tokens and req.get("logprobs"):
            choice["logprobs"] = {"content": _logprob_content(tok, ids)}
        if with_tokens and req.get("return_token_ids"):
            choice["token_ids"] = ids
            body["prompt_token_ids"] = prompt
    elif kind == "sglang":
        message["content"] = s["content"] or ""
        message["reasoning_content"] = s["reasoning"]
        message["tool_calls"] = calls or None
        choice["matched_stop"] = ids[-1] if s["finish"] != "length" and ids else None
        if req.get("logprobs"):
            choice["logprobs"] = {"content": _logprob_content(tok, ids)}
        if with_tokens and req.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = prompt
        if with_tokens and req.get("return_meta_info"):
            meta: dict[str, Any] = {
                "id": body["id"],
                "finish_reason": {"type": s["finish"], "matched": choice["matched_stop"]},
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "weight_version": s["weight_version"],
            }
            if req.get("logprobs"):
                meta["output_token_logprobs"] = [[logprob(pos, i), i, None] for pos, i in enumerate(ids)]
            choice["meta_info"] = meta
        body["metadata"] = {"weight_version": s["weight_version"]}
    else:
        if s["reasoning"] is not None:
            message["reasoning_content"] = s["reasoning"]
        if calls:
            message["tool_calls"] = calls
    return body
