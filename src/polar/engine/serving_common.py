"""Request checks shared by the chat and completion endpoints: model name, context length, sampling."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from polar.engine.engine import Engine
from polar.engine.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from polar.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T", bound=BaseModel)


def parse_body(raw: bytes, schema: type[T]) -> T:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", param="body") from exc
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", param="body")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def check_model(engine: Engine, model: str | None) -> None:
    """vLLM answers an unknown model with 404 NotFoundError and `param: "model"`."""
    if model is not None and model != engine.name:
        raise APIError(404, f"The model `{model}` does not exist.", param="model")


def check_supported(req: ChatCompletionRequest | CompletionRequest) -> None:
    bad = req.unsupported()
    if bad is not None:
        raise APIError(
            400, f"{bad}: not supported by the polar engine (only its neutral value is)", param=bad
        )


def resolve_max_tokens(engine: Engine, prompt_len: int, requested: int | None, param: str) -> int:
    """Apply vLLM's context checks and wording; default to the rest of the context (capped by config)."""
    limit = engine.max_model_len
    if requested is not None and requested > limit:
        raise APIError(
            400,
            f"{param}={requested} cannot be greater than max_model_len={limit}. Please request fewer output tokens.",
            param=param,
        )
    if prompt_len >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages. "
            f"(parameter=input_tokens, value={prompt_len})",
            param="input_tokens",
        )
    if requested is not None and prompt_len > limit - requested:
        raise APIError(
            400,
            f"You passed {prompt_len} input tokens and requested {requested} output tokens. However, the "
            f"model's context length is only {limit} tokens, resulting in a maximum input length of "
            f"{limit - requested} tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={prompt_len})",
            param="input_tokens",
        )
    if requested is not None:
        return requested
    room = limit - prompt_len
    return min(room, engine.default_max_tokens) if engine.default_max_tokens else room


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    *,
    top_logprobs: int,
    skip_special_tokens: bool,
    seed_offset: int,
) -> SamplingParams:
    stop = req.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    seed = None if req.seed is None else req.seed + seed_offset
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=seed,
        stop=stops,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        top_logprobs=top_logprobs,
        skip_special_tokens=skip_special_tokens,
    )


class TokenText:
    """Token ids to the strings logprob entries carry (vLLM decodes each id alone); one per engine."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        @lru_cache(maxsize=65536)
        def _one(token_id: int) -> str:
            return str(tokenizer.decode([token_id]))

        self._one = _one

    def __call__(self, token_id: int, as_id: bool = False) -> str:
        return f"token_id:{token_id}" if as_id else self._one(token_id)


_NAMES: dict[int, TokenText] = {}


def token_text(engine: Engine) -> TokenText:
    names = _NAMES.get(id(engine.tokenizer))
    if names is None:
        names = _NAMES[id(engine.tokenizer)] = TokenText(engine.tokenizer)
    return names


def finite(lp: float) -> float:
    """JSON has no -inf; vLLM reports -9999.0 for impossible tokens."""
    return lp if lp > -9999.0 else -9999.0


def chat_logprob_entries(
    names: TokenText,
    ids: list[int],
    lps: list[float],
    tops: list[list[tuple[int, float]]] | None,
    as_ids: bool,
) -> list[dict[str, Any]]:
    entries = []
    for i, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
        tok = names(tid, as_ids)
        top = []
        if tops is not None:
            for t, v in tops[i]:
                s = names(t, as_ids)
                top.append({"token": s, "logprob": finite(v), "bytes": list(s.encode("utf-8", "replace"))})
        entries.append(
            {
                "token": tok,
                "logprob": finite(lp),
                "bytes": list(tok.encode("utf-8", "replace")),
                "top_logprobs": top,
            }
        )
    return entries


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
