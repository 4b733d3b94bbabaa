"""The gateway rendering prompts itself and sending token ids (`render: gateway`, opt-in per gateway).

`Template` is the served model's chat format (render, render a delta, read an answer back), `Chain` a
session's token chain, `RenderingBackend` the client that answers chat calls from `/v1/completions`.
`rendering` turns the started client of a gateway into that one, once the served model is known.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from polar.gateway.backends.base import Backend
from polar.gateway.backends.openai import TokenizingBackend
from polar.gateway.errors import GatewayError
from polar.gateway.render.backend import FLAG_RENDERED, RenderingBackend
from polar.gateway.render.chain import Chain, Prompt
from polar.gateway.render.template import Template, TemplateUnusable
from polar.jsontypes import JSON

__all__ = [
    "FLAG_RENDERED",
    "Chain",
    "Prompt",
    "RenderingBackend",
    "Template",
    "TemplateUnusable",
    "rendering",
]

log = logging.getLogger("polar.gateway")


async def rendering(
    backend: Backend,
    served_model: str,
    tokenizer: str | None,
    tool_parser: str = "auto",
    reasoning_parser: str = "auto",
) -> Backend:
    """`backend` (a started vllm client, or a pool of them: `GatewayConfig` refuses `render: gateway` with
    any other kind) rendering with the served model's tokenizer: `tokenizer` (a folder, or a model id in the
    local Hugging Face cache), else what the server says it loaded the model from (`root` in vLLM's
    /v1/models); raises `TemplateUnusable` naming what is missing."""
    from polar.gateway.backends.pool import BackendPool

    first = backend.servers[0].backend if isinstance(backend, BackendPool) else backend
    assert isinstance(first, TokenizingBackend)
    card = await _model_card(first, served_model)
    folder = tokenizer or card.get("root")
    if not isinstance(folder, str) or not folder:
        raise TemplateUnusable(f"the server does not say where {served_model} is from; pass --tokenizer")
    template = await asyncio.to_thread(Template.load, folder, tool_parser, reasoning_parser)
    context = _positive(card.get("max_model_len"))
    default = _positive(card.get("default_max_tokens"))  # the embedded engine's cap on a chat call's budget
    log.info(
        "gateway renders prompts with the tokenizer at %s (tool parser %s, reasoning %s)",
        folder,
        getattr(template.parser, "name", None),
        template.reasoning,
    )
    if isinstance(backend, BackendPool):
        for s in backend.servers:
            assert isinstance(s.backend, TokenizingBackend)
            s.backend = RenderingBackend(s.backend, template, context, default)
        return backend
    assert isinstance(backend, TokenizingBackend)
    return RenderingBackend(backend, template, context, default)


async def _model_card(backend: TokenizingBackend, served_model: str) -> dict[str, Any]:
    """The server's entry for `served_model` in /v1/models: vLLM's has `root` (what it loaded the model
    from) and `max_model_len`."""
    try:
        data: JSON = await backend.http.get(backend.models_path)
    except GatewayError as err:
        raise TemplateUnusable(f"could not list the models of {backend.url} ({err.message})") from None
    items = data.get("data") if isinstance(data, dict) else None
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict) and item.get("id") == served_model:
            return item
    raise TemplateUnusable(f"the server at {backend.url} does not list {served_model}")


def _positive(value: JSON) -> int | None:
    return value if type(value) is int and value > 0 else None
