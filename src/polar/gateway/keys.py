"""Where each dialect's clients put their API key, which for us is the session id.

OpenAI SDKs send `Authorization: Bearer`, Anthropic's `x-api-key` (or Bearer with ANTHROPIC_AUTH_TOKEN),
google-genai `x-goog-api-key`, and older Gemini clients `?key=`.
"""

from __future__ import annotations

from starlette.requests import Request


def session_key(request: Request) -> str | None:
    headers = request.headers
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    for name in ("x-api-key", "x-goog-api-key"):
        value = headers.get(name)
        if value:
            return value.strip()
    key = request.query_params.get("key")
    return key.strip() if key else None
