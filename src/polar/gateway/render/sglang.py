"""SGLang's native `/generate` spoken as vLLM's `/v1/completions`, for `render: gateway` on an sglang server.

The rendering client (`RenderingBackend`) builds a `/v1/completions` body and reads `/v1/completions`
answers; on an SGLang server the body becomes a `/generate` body with `input_ids`, and each answer is read
back into the completions shape, so one reader serves both. Matched against SGLang main of mid-2026
(python/sglang/srt/managers/io_struct.py `GenerateReqInput`, sampling/sampling_params.py `SamplingParams`,
tokenizer_manager_components/output_processor.py):

- the request: `input_ids`, `sampling_params` (`max_new_tokens`, `temperature`, `top_p`, `top_k`,
  `min_p`, the penalties, `stop`, `stop_token_ids`, `sampling_seed`, `json_schema`, ...), `stream`,
  `return_logprob` with `logprob_start_len: -1` (the sampled tokens' logprobs only);
- the answer: `text`, `output_ids` and `meta_info` with `id`, `finish_reason` (`{"type": "stop" |
  "length" | "abort", ...}`, null until the end), `prompt_tokens`, `completion_tokens`, `weight_version`
  and `output_token_logprobs`, one `[logprob, token_id, text]` per sampled token;
- streamed, each `data:` event carries the whole answer so far (text, ids, logprobs), unless the server runs
  with `--incremental-streaming-output`, where each carries only what is new; `completion_tokens` counts
  the whole answer in both, which tells them apart.

Unlike SGLang's chat route (`polar.gateway.backends.sglang`: the training fields are refused on streamed
requests, so a harness's stream arrives whole), `/generate` returns ids and logprobs while streaming.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from polar.gateway.backends.base import upstream_error
from polar.gateway.errors import invalid
from polar.jsontypes import JSON

GENERATE = "/generate"
# /v1/completions field -> SGLang sampling_params field, for the settings both have.
_SAMPLING = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "logit_bias": "logit_bias",
    "seed": "sampling_seed",
}
# Fields that change nothing SGLang samples (names, bookkeeping, what the completions reader asks vLLM for).
_IGNORED = frozenset(
    {
        "model",
        "prompt",
        "stream",
        "stream_options",
        "return_token_ids",
        "logprobs",
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "n",  # 1 is all a harness call samples; more is refused below
    }
)


def generate_body(completions: dict[str, Any]) -> dict[str, Any]:
    """The `/generate` body for a `/v1/completions` body whose `prompt` is token ids. A sampling setting
    `/generate` has no equivalent for is a 400 naming it (never dropped: it would change what is sampled)."""
    sampling: dict[str, Any] = {}
    for key, value in completions.items():
        if key in _SAMPLING:
            if value is not None:
                sampling[_SAMPLING[key]] = value
        elif key == "response_format":
            schema = _json_schema(value)
            if schema is not None:
                sampling["json_schema"] = schema
        elif key == "n":
            if value not in (None, 1):
                raise invalid("render: gateway on an sglang server samples one answer per call (n: 1)", "n")
        elif key not in _IGNORED:
            raise invalid(f"render: gateway on an sglang server cannot send `{key}` to its /generate", key)
    return {
        "input_ids": list(completions["prompt"]),
        "sampling_params": sampling,
        "stream": bool(completions.get("stream")),
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def _json_schema(value: JSON) -> str | None:
    """SGLang's `json_schema` (a JSON string) for an OpenAI `response_format`; None for plain text."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema" and isinstance(value.get("json_schema"), dict):
        schema = value["json_schema"].get("schema")
        if isinstance(schema, dict):
            return json.dumps(schema)
    raise invalid("response_format must be text, json_object or json_schema with a schema", "response_format")


def completion_of(raw: Any, model: str) -> dict[str, Any]:
    """A `/generate` answer as a `/v1/completions` one: its text, the sampled ids with their logprobs (left
    out, so the reader flags them, when `output_ids` disagrees with them), finish reason and usage."""
    meta = _meta(raw)
    ids, logprobs = _sampled(meta)
    output_ids = raw.get("output_ids")
    if ids is not None and isinstance(output_ids, list) and output_ids != ids:
        ids = logprobs = None  # two accounts of what was sampled that disagree: neither is trusted
    return _answer(meta, model, raw.get("text"), ids, logprobs, _finish(meta))


@dataclass
class StreamReader:
    """Turns `/generate` stream events (the whole answer so far, or only what is new) into
    `/v1/completions` stream chunks holding only what is new."""

    model: str
    tokens: int = 0  # sampled tokens passed on
    text: str = ""  # text passed on

    def chunk(self, raw: Any) -> dict[str, Any]:
        meta = _meta(raw)
        ids, logprobs = _sampled(meta)
        total = meta.get("completion_tokens")
        output_ids = raw.get("output_ids")
        text = raw.get("text")
        whole = type(total) is int and isinstance(output_ids, list) and len(output_ids) == total
        if whole and self.tokens:  # the answer so far: keep what is new
            output_ids = output_ids[self.tokens :]
            if ids is not None and logprobs is not None and len(ids) == total:
                ids, logprobs = ids[self.tokens :], logprobs[self.tokens :]
            if isinstance(text, str):
                if not text.startswith(self.text):
                    raise upstream_error("SGLang's streamed text does not continue what it sent before")
                text = text[len(self.text) :]
        if ids is not None and isinstance(output_ids, list) and output_ids != ids:
            ids = logprobs = None
        finish = _finish(meta)
        out = _answer(meta, self.model, text, ids, logprobs, finish, stream=True)
        self.tokens += len(output_ids) if isinstance(output_ids, list) else 0
        self.text += text if isinstance(text, str) else ""
        return out


async def completions_stream(events: AsyncIterator[Any], model: str) -> AsyncIterator[dict[str, Any]]:
    """`/generate` stream events as `/v1/completions` stream chunks."""
    reader = StreamReader(model)
    async for event in events:
        yield reader.chunk(event)


def _meta(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise upstream_error("SGLang's /generate answer is not an object")
    if "error" in raw and "meta_info" not in raw:
        error = raw["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise upstream_error(f"SGLang's /generate failed: {message}")
    meta = raw.get("meta_info")
    if not isinstance(meta, dict):
        raise upstream_error("SGLang's /generate answer has no `meta_info`")
    return meta


def _sampled(meta: dict[str, Any]) -> tuple[list[Any] | None, list[Any] | None]:
    """(ids, logprobs) from `output_token_logprobs`, or (None, None) when it is missing or malformed."""
    entries = meta.get("output_token_logprobs")
    if type(entries) is not list:
        return None, None
    try:
        return [e[1] for e in entries], [e[0] for e in entries]
    except (TypeError, IndexError, KeyError):
        return None, None


def _finish(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind is None:
        return None
    if kind == "abort":
        message = reason.get("message") if isinstance(reason, dict) else None
        raise upstream_error(f"inference server aborted the generation ({message or 'finish_reason abort'})")
    return kind if kind in ("stop", "length") else str(kind)


def _answer(
    meta: dict[str, Any],
    model: str,
    text: JSON,
    ids: list[Any] | None,
    logprobs: list[Any] | None,
    finish: str | None,
    *,
    stream: bool = False,
) -> dict[str, Any]:
    rid = meta.get("id")
    choice: dict[str, Any] = {
        "index": 0,
        "text": text if isinstance(text, str) else "",
        "token_ids": ids,
        "logprobs": {"token_logprobs": logprobs} if logprobs is not None else None,
        "finish_reason": finish,
    }
    out: dict[str, Any] = {
        "id": f"cmpl-{rid}" if isinstance(rid, str) else "",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if not stream or finish is not None:
        prompt, completion = meta.get("prompt_tokens"), meta.get("completion_tokens")
        if type(prompt) is int and type(completion) is int:
            out["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
    version = meta.get("weight_version")
    if type(version) is int or (isinstance(version, str) and version.isdigit()):
        out["policy_version"] = int(version)
    return out
