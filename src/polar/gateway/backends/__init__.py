"""Clients of the policy's inference server, one module per server kind."""

from __future__ import annotations

from polar.gateway.backends.base import Backend, BackendOptions
from polar.gateway.backends.openai import OpenAIBackend
from polar.gateway.backends.sglang import SGLangBackend
from polar.gateway.backends.vllm import VLLMBackend

__all__ = ["Backend", "BackendOptions", "OpenAIBackend", "SGLangBackend", "VLLMBackend", "make_backend"]

_KINDS: dict[str, type[OpenAIBackend]] = {
    "vllm": VLLMBackend,
    "sglang": SGLangBackend,
    "openai": OpenAIBackend,
}


def make_backend(kind: str, url: str, options: BackendOptions | None = None) -> Backend:
    """The client for a server of `kind` ("vllm", "sglang" or "openai") at `url`.

    vllm/sglang: `url` is the server root (`http://host:8000`, a trailing `/v1` is fine); our embedded engine
    is a `vllm` kind. openai: `url` is the OpenAI base URL (`https://host/v1`).
    """
    try:
        cls = _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown backend kind {kind!r}; expected one of {', '.join(_KINDS)}") from None
    return cls(url, options or BackendOptions())
