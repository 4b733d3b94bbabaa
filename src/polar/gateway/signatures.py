"""Opaque reasoning round-trips.

Anthropic thinking blocks carry a `signature`, Responses reasoning items an `encrypted_content`, Gemini parts a
`thoughtSignature`. Real providers use them to hide or verify reasoning; we make them ourselves so that when
a harness sends its history back, the reasoning the policy actually produced is restored verbatim, even when
the harness dropped or summarized the visible text. The token is `p1.` + base64url(zlib(text)) + `.` + a
truncated HMAC, so a forged or foreign signature is recognised and ignored rather than trusted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import zlib

_PREFIX = "p1."


class ReasoningCodec:
    """Encodes reasoning text into an opaque, authenticated token and back."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _tag(self, payload: bytes) -> str:
        mac = hmac.new(self._key, payload, hashlib.sha256).digest()[:12]
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def encode(self, text: str) -> str:
        payload = base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"), 6)).rstrip(b"=")
        return f"{_PREFIX}{payload.decode()}.{self._tag(payload)}"

    def decode(self, token: str | None) -> str | None:
        """The reasoning text a token carries, or None when it is not one of ours (or was tampered with)."""
        if not isinstance(token, str) or not token.startswith(_PREFIX):
            return None
        body = token[len(_PREFIX) :]
        payload_s, _, tag = body.rpartition(".")
        if not payload_s or not tag:
            return None
        payload = payload_s.encode()
        if not hmac.compare_digest(tag, self._tag(payload)):
            return None
        try:
            raw = base64.urlsafe_b64decode(payload + b"=" * (-len(payload) % 4))
            return zlib.decompress(raw).decode("utf-8")
        except (binascii.Error, zlib.error, UnicodeDecodeError, ValueError):
            return None
