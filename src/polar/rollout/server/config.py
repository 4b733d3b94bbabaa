"""The rollout server's settings (clocks, limits, retry policy), fixed at start."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from polar.auth import MIN_TOKEN_CHARS, new_token
from polar.limits import DEFAULT_BODY_TIMEOUT_S
from polar.netguard import OutboundPolicy
from polar.rollout.server.callbacks import RetryPolicy


@dataclass(frozen=True)
class ServerConfig:
    db_path: Path = Path("polar-server.db")
    public_url: str | None = None  # how nodes reach this server (default: the URL a node registered to)
    heartbeat_timeout_s: float = 15.0  # no heartbeat for this long: unhealthy, gets no new sessions
    node_lost_after_s: float = 120.0  # no answer at all for this long: gone, its sessions end as ERROR
    node_timeout_s: float = 10.0  # per HTTP call to a node (dispatch, probe, cancel)
    probe_interval_s: float = 2.0  # how often one unsettled session is asked about
    audit_interval_s: float = 30.0  # how often a settled session on a healthy node is asked about
    refuse_cooldown_s: float = 1.0  # a node that refused a dispatch gets none for this long
    max_dispatch_attempts: int = 5  # a session refused this often ends as ERROR
    tick_s: float = 0.5
    # How long a queued session may be passed over for a free slot where its container image is not, while
    # a busy node holds (or fetches) it: about what pulling an image costs (bench/placement.py).
    locality_wait_s: float = 60.0
    callbacks: RetryPolicy = field(default_factory=RetryPolicy)
    max_body_bytes: int = 64 << 20
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a body not received whole by then is refused (408)
    # Where tasks' callback and side-call URLs may point (checked at submit; callbacks again at delivery).
    outbound: OutboundPolicy = field(default_factory=OutboundPolicy)
    # The deployment's control token (`polar.auth`): every route but /health needs it, and the server sends
    # it to nodes. A random one when not given, so a server is never open.
    token: str = field(default_factory=new_token)

    def __post_init__(self) -> None:
        if len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(f"token must be at least {MIN_TOKEN_CHARS} characters")
