"""Gateway errors, dialect-neutral.

Every failure on the request path is raised as a `GatewayError` with a `kind`; each dialect maps kinds to
its own status codes and error envelope, so a harness always sees an error its SDK understands.
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal[
    "invalid_request",  # malformed JSON, wrong types, missing or unsupported fields (400)
    "authentication",  # missing or unknown session key (401)
    "permission",  # control plane without its token (403)
    "not_found",  # unknown route, model or session (404)
    "request_too_large",  # body over the configured limit (413)
    "context_length",  # prompt longer than the model's context (400, dialect-specific wording)
    "rate_limit",  # upstream 429 (429)
    "upstream_error",  # upstream 5xx, garbage, refused connection (502)
    "overloaded",  # gateway paused or draining (503; Anthropic 529)
    "timeout",  # upstream took longer than allowed (504)
]

DEFAULT_STATUS: dict[str, int] = {
    "invalid_request": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "request_too_large": 413,
    "context_length": 400,
    "rate_limit": 429,
    "upstream_error": 502,
    "overloaded": 503,
    "timeout": 504,
}


class GatewayError(Exception):
    """A failure with a kind, a human message and, where one is to blame, the offending field (`param`).

    `prompt_tokens`/`max_tokens` are filled for `context_length` so dialects can phrase the message the way
    their clients recognise ("prompt is too long: N tokens > M maximum" for Claude Code, for instance).
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        status: int | None = None,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.param = param
        self.status = status if status is not None else DEFAULT_STATUS[kind]
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens

    def __repr__(self) -> str:
        return f"GatewayError({self.kind!r}, {self.message!r}, param={self.param!r}, status={self.status})"


def invalid(message: str, param: str | None = None) -> GatewayError:
    """Shorthand for the most common error: the caller sent something we cannot accept."""
    return GatewayError("invalid_request", message, param=param)
