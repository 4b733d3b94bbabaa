"""Fitting a call's `max_tokens` into the server's context, instead of passing on the server's 400.

Harnesses ask for output budgets that ignore the server's context: Qwen Code resends a prompt cut by
`finish_reason=length` with `max_tokens=64000`, whatever the model serves. vLLM 0.32 refuses a `max_tokens`
above `max_model_len` ("max_tokens=64000 cannot be greater than max_model_len=32768"), vLLM 0.11 and SGLang
refuse any prompt plus `max_tokens` over it; either way the harness gets a 400 and the session breaks on
something the gateway can settle. So the refused call is sent once more, with `max_tokens` = what fits
(context - prompt), and its record says so (`FLAG_MAX_TOKENS_CLAMPED`, `max_tokens_requested:N`).

Only a refused call pays: the server's message gives its context length (every wording the gateway knows,
`backends.http._MAX_PATTERNS`) and usually the prompt's length; when it does not, the prompt is counted with
the server's own `/tokenize` (`Backend.count_tokens`). When nothing fits (the prompt alone fills the
context) the server's context-length error stands, as before.
"""

from __future__ import annotations

from typing import Any

from polar.gateway.backends.base import Backend
from polar.gateway.canonical import CanonicalRequest
from polar.gateway.errors import GatewayError
from polar.store.records import FLAG_MAX_TOKENS_CLAMPED

REQUESTED = "max_tokens_requested:"


def requested_flag(requested: int) -> str:
    return f"{REQUESTED}{requested}"


def clamp(requested: int, context: int, prompt_len: int) -> tuple[int, tuple[str, ...]] | None:
    """(the `max_tokens` that fits after a `prompt_len`-token prompt in `context`, the record's flags), or
    None when `requested` already fits or nothing does (the prompt alone fills the context)."""
    fits = context - prompt_len
    if fits < 1 or fits >= requested:
        return None
    return fits, (FLAG_MAX_TOKENS_CLAMPED, requested_flag(requested))


async def fit_max_tokens(
    backend: Backend, req: CanonicalRequest, upstream: dict[str, Any], err: GatewayError
) -> tuple[dict[str, Any], tuple[str, ...]] | None:
    """(the upstream body with `max_tokens` cut to what fits, the record's flags) for a call the server
    refused for its context, or None when cutting cannot help (no `max_tokens` asked, the context length
    unknown, the prompt alone filling the context, or the refusal not about the context)."""
    if err.kind != "context_length" or err.max_tokens is None:
        return None
    key = "max_completion_tokens" if "max_completion_tokens" in upstream else "max_tokens"
    requested = upstream.get(key)
    if type(requested) is not int:
        return None
    prompt = err.prompt_tokens
    if prompt is None:
        try:
            prompt = await backend.count_tokens(req, str(upstream.get("model", "")))
        except GatewayError:
            return None
    cut = clamp(requested, err.max_tokens, prompt)
    if cut is None:
        return None
    return {**upstream, key: cut[0]}, cut[1]
