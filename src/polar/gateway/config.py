"""Gateway settings, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from polar.auth import MIN_TOKEN_CHARS, new_token
from polar.gateway.backends.base import BackendOptions
from polar.gateway.backends.prompt_ids import DEFAULT_MEMO_BYTES
from polar.limits import DEFAULT_BODY_TIMEOUT_S
from polar.netguard import OutboundPolicy
from polar.store.cache import DEFAULT_CACHE_BYTES, DEFAULT_IDLE_S

BackendKind = Literal["vllm", "sglang", "openai"]


@dataclass(frozen=True)
class GatewayConfig:
    """`backend_url` is the inference server; several servers of one kind go in `backend_urls` (spread by
    `polar.gateway.backends.pool`). Either may be given: after construction `backend_urls` holds every
    server and `backend_url` the first."""

    backend_url: str = ""
    backend_urls: tuple[str, ...] = ()
    backend_kind: BackendKind = "vllm"
    served_model: str | None = None  # None: ask the backend's /v1/models at start-up
    store_path: Path = Path("polar.db")
    durability: Literal["normal", "full"] = "normal"
    # The control listener's token (`polar.auth`); a random one when not given, so no gateway ever serves
    # its control plane unauthenticated.
    control_token: str = field(default_factory=new_token)
    max_body_bytes: int = 32 << 20
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a body not received whole by then is refused (408)
    backend: BackendOptions = field(default_factory=BackendOptions)
    reasoning_key: bytes | None = None  # HMAC key of reasoning signatures; default: one kept in the store
    host: str = "127.0.0.1"  # the data plane (model API): what harnesses reach
    port: int = 8100
    control_host: str = "127.0.0.1"  # the control plane: never reachable from a session's sandbox
    control_port: int = 0  # 0: any free port
    # Where sessions' side-call routes (task-given URLs) may connect; checked at every connection.
    outbound: OutboundPolicy = field(default_factory=OutboundPolicy)
    # One one-token call at start-up proves a vllm/sglang backend returns token ids and logprobs; a server
    # that does not is refused (`--backend-kind openai` declares a token-less server on purpose).
    check_token_data: bool = True
    # Memory for live sessions (`polar.store.cache`): what storing the next call as a delta needs, at most
    # this many bytes, dropped when a session closes or has been idle for `session_idle_s` (the registry
    # forgets it then too). Smaller only costs disk: the next call of a forgotten session is stored whole.
    session_cache_bytes: int = DEFAULT_CACHE_BYTES
    session_idle_s: float = DEFAULT_IDLE_S
    # Live sessions' previous prompt ids, so a call decodes only the ids its prompt adds
    # (`polar.gateway.backends.prompt_ids`): at most this many bytes. Smaller only costs CPU.
    prompt_memo_bytes: int = DEFAULT_MEMO_BYTES
    # Several servers only: keep a session on the server holding its prefix, and how often each is probed.
    backend_affinity: bool = True
    health_interval_s: float = 5.0
    # Who renders the chat template (`polar.gateway.render`): the server (vLLM's chat route), or the gateway,
    # which continues each session's token chain and sends token ids: to /v1/completions (vllm kind: vLLM
    # or the embedded engine) or /generate (sglang kind); an openai kind server takes no token ids.
    render: Literal["server", "gateway"] = "server"
    # render: gateway only. The served model's folder for its tokenizer and template (default: the folder
    # the server reports for the model); its tool-call and reasoning parsers ("auto": from the template).
    tokenizer: str | None = None
    tool_parser: str = "auto"
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        urls = tuple(u.rstrip("/") for u in self.backend_urls or (self.backend_url,) if u)
        if not urls:
            raise ValueError("a gateway needs an inference server: backend_url or backend_urls")
        if self.backend_url and self.backend_url.rstrip("/") not in urls:
            raise ValueError(f"backend_url {self.backend_url!r} is not one of backend_urls")
        if len(set(urls)) != len(urls):
            raise ValueError(f"backend_urls names a server twice: {', '.join(urls)}")
        object.__setattr__(self, "backend_urls", urls)
        object.__setattr__(self, "backend_url", urls[0])
        if self.backend_kind not in ("vllm", "sglang", "openai"):
            raise ValueError(f"backend_kind must be vllm, sglang or openai, not {self.backend_kind!r}")
        if self.render not in ("server", "gateway"):
            raise ValueError(f"render must be server or gateway, not {self.render!r}")
        if self.render == "gateway" and self.backend_kind == "openai":
            raise ValueError(
                "render: gateway sends token ids (vLLM's /v1/completions, SGLang's /generate): it needs "
                "backend_kind vllm (vLLM or the embedded engine) or sglang, not openai"
            )
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend_url must be an http(s) URL, not {url!r}")
        if len(self.control_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"control_token must be at least {MIN_TOKEN_CHARS} characters")
        if self.control_port != 0 and (self.control_host, self.control_port) == (self.host, self.port):
            raise ValueError("the control listener needs its own port (control_port), not the data port")
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        if self.health_interval_s < 0:
            raise ValueError("health_interval_s must be 0 (no probes) or more")
        if not self.body_timeout_s > 0:
            raise ValueError("body_timeout_s must be positive")
        if self.session_cache_bytes < 0:
            raise ValueError("session_cache_bytes must be zero or more")
        if self.prompt_memo_bytes < 0:
            raise ValueError("prompt_memo_bytes must be zero or more")
        if not self.session_idle_s > 0:
            raise ValueError("session_idle_s must be positive")
