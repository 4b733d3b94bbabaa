"""Gateway settings, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from polar.gateway.backends.base import BackendOptions
from polar.limits import DEFAULT_BODY_TIMEOUT_S

BackendKind = Literal["vllm", "sglang", "openai"]


@dataclass(frozen=True)
class GatewayConfig:
    backend_url: str
    backend_kind: BackendKind = "vllm"
    served_model: str | None = None  # None: ask the backend's /v1/models at start-up
    store_path: Path = Path("polar.db")
    durability: Literal["normal", "full"] = "normal"
    control_token: str | None = None  # when set, /sessions and /admin need `Authorization: Bearer <token>`
    max_body_bytes: int = 32 << 20
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a body not received whole by then is refused (408)
    backend: BackendOptions = field(default_factory=BackendOptions)
    reasoning_key: bytes | None = None  # HMAC key of reasoning signatures; default: one kept in the store
    host: str = "127.0.0.1"
    port: int = 8100

    def __post_init__(self) -> None:
        if self.backend_kind not in ("vllm", "sglang", "openai"):
            raise ValueError(f"backend_kind must be vllm, sglang or openai, not {self.backend_kind!r}")
        if not self.backend_url.startswith(("http://", "https://")):
            raise ValueError(f"backend_url must be an http(s) URL, not {self.backend_url!r}")
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        if not self.body_timeout_s > 0:
            raise ValueError("body_timeout_s must be positive")
