"""Outbound URL policy: where a task's `callback_url` and `agent.side_call_backend.url` may point.

Both URLs come from untrusted task submitters and are fetched by our servers (the rollout server POSTs
results to the callback, a node's gateway forwards side calls to the frozen backend), so without a check a
task can make them reach internal listeners or a cloud metadata service (SSRF). One `OutboundPolicy` decides
for both uses:

- link-local addresses (169.254.0.0/16, fe80::/10) and cloud metadata addresses and names are never
  reachable, whatever the allowlist says;
- an address or host on the operator's allowlist (`--allow-callback HOST_OR_CIDR`) is reachable;
- anything else must be a public (global unicast) address: loopback, private, shared, reserved, multicast
  and unspecified addresses need an allowlist entry.

It is applied twice. At submit, `vet` resolves the URL's host and refuses it unless every address passes,
so the submitter gets a 400 naming the field. At connect, `guarded_session` gives an aiohttp session whose
resolver drops refused addresses (refusing when none remain), so a name that resolved to a public address
at submit and to 127.0.0.1 later (DNS rebinding) is refused when it matters; IP literals, which aiohttp never
resolves, are checked as each request starts. Hosts written as integers or hex (`0x7f000001`) are not IP
literals to `ipaddress`: they are names, resolved by getaddrinfo (which parses them as inet_aton does), and
every address it yields is checked.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Lookup = Callable[[str, int], Awaitable[Sequence[str]]]

LOOKUP_TIMEOUT_S = 10.0

_net = ipaddress.ip_network
# Never reachable, even when allowlisted: link-local (where most clouds serve instance metadata and
# credentials) and the metadata endpoints that live elsewhere.
NEVER_NETS: tuple[IPNetwork, ...] = (
    _net("169.254.0.0/16"),  # link-local; AWS, GCP, Azure, OCI, DigitalOcean metadata at .169.254
    _net("fe80::/10"),  # IPv6 link-local
    _net("fd00:ec2::254/128"),  # AWS metadata over IPv6
    _net("fd20:ce::254/128"),  # GCP metadata over IPv6
    _net("100.100.100.200/32"),  # Alibaba Cloud metadata
    _net("192.0.0.192/32"),  # Oracle Cloud legacy metadata
    _net("168.63.129.16/32"),  # Azure WireServer (host agent: certificates, configuration); a public address
)
NEVER_NAMES = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.tencentyun.com",
    }
)
# Special-purpose ranges that `ipaddress.is_global` calls global on some Python versions.
_NOT_PUBLIC: tuple[IPNetwork, ...] = (
    _net("192.0.0.0/24"),  # IETF protocol assignments
    _net("2001::/23"),  # IETF protocol assignments (Teredo included)
    _net("2001:db8::/32"),  # documentation
    _net("2002::/16"),  # 6to4: an IPv4 address in disguise
    _net("3fff::/20"),  # documentation
)
_GLOBAL_UNICAST_V6 = _net("2000::/3")
_SHARED = _net("100.64.0.0/10")
_NAT64 = _net("64:ff9b::/96")
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$"
)


class OutboundRefused(Exception):
    """The policy refuses this destination; the message says why."""


async def system_lookup(host: str, port: int) -> list[str]:
    """Every address getaddrinfo gives for `host` (numeric forms such as `0x7f000001` included)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _normalize(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (`::ffff:127.0.0.1`) is the IPv4 address it reaches; drop scope ids."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.scope_id:
            return ipaddress.IPv6Address(str(ip).split("%", 1)[0])
    return ip


def _embedded_v4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries (6to4, Teredo, NAT64, IPv4-compatible)."""
    out = [a for a in (ip.sixtofour, ip.teredo[1] if ip.teredo else None) if a is not None]
    if ip in _NAT64 or int(ip) >> 32 == 0:
        out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def _never(ip: IPAddress) -> bool:
    candidates = [ip, *(_embedded_v4(ip) if isinstance(ip, ipaddress.IPv6Address) else [])]
    return any(c in net for c in candidates for net in NEVER_NETS if c.version == net.version)


def _public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip not in _GLOBAL_UNICAST_V6:
        return False
    if ip.is_multicast or ip.is_reserved or not ip.is_global:
        return False
    return not any(ip in net for net in _NOT_PUBLIC if ip.version == net.version)


def _kind(ip: IPAddress) -> str:
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_unspecified:
        return "the unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if ip in _SHARED:
        return "a shared (carrier-grade NAT) address"
    if ip.is_private:
        return "a private or special-purpose address"
    return "not a public unicast address"


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _host_name(host: str) -> str:
    return host.lower().rstrip(".")


def _allow_entry(entry: str) -> IPNetwork | str:
    """An allowlist entry as a network, or as a normalized host name; ValueError if it is neither or
    names what is never allowed."""
    raw = entry.strip()
    try:
        net = ipaddress.ip_network(raw.strip("[]"), strict=False)
    except ValueError:
        net = None
    if net is None:
        name = _host_name(raw)
        if not _HOSTNAME.match(name):
            raise ValueError(f"allowlist entry {entry!r} is neither an IP, a CIDR nor a host name")
        if name in NEVER_NAMES:
            raise ValueError(f"allowlist entry {entry!r}: cloud metadata hosts are never allowed")
        return name
    if any(net.version == n.version and net.subnet_of(n) for n in NEVER_NETS):  # type: ignore[arg-type]
        raise ValueError(f"allowlist entry {entry!r}: link-local and metadata addresses are never allowed")
    return net


def parse_url(url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL; OutboundRefused when it is not one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise OutboundRefused(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OutboundRefused("only http(s) URLs with a host are allowed")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class OutboundPolicy:
    """The allowlist (IP addresses, CIDRs or exact host names) and how names are resolved.

    `lookup` resolves a host to address strings; the default asks the system (getaddrinfo). It is a field
    so a deployment can plug in its own resolver, and tests can change what a name resolves to.
    """

    allow: tuple[str, ...] = ()
    lookup: Lookup = field(default=system_lookup, compare=False, repr=False)
    _nets: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)
    _names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        entries = [_allow_entry(entry) for entry in self.allow]
        object.__setattr__(self, "_nets", tuple(e for e in entries if not isinstance(e, str)))
        object.__setattr__(self, "_names", frozenset(e for e in entries if isinstance(e, str)))

    def refusal(self, address: str | IPAddress, host: str | None = None) -> str | None:
        """Why `address` (reached as `host`, a name or None for an IP literal) is refused; None: allowed."""
        try:
            ip = _normalize(ipaddress.ip_address(address) if isinstance(address, str) else address)
        except ValueError:
            return f"{address!r} is not an IP address"
        if _never(ip):
            return f"{ip} is a link-local or cloud metadata address, which is never allowed"
        if host is not None and _host_name(host) in self._names:
            return None
        if any(ip in net for net in self._nets if ip.version == net.version):
            return None
        if _public(ip):
            return None
        return f"{ip} is {_kind(ip)}, not on the outbound allowlist (--allow-callback)"

    def check_host(self, host: str) -> IPAddress | None:
        """The name-level and literal checks (no resolution): refuses metadata names and any IP literal the
        policy refuses. Returns the literal, or None when `host` is a name still to be resolved."""
        if _host_name(host) in NEVER_NAMES:
            raise OutboundRefused(f"{host} is a cloud metadata host, which is never allowed")
        ip = _literal(host.strip("[]"))
        if ip is not None and (reason := self.refusal(ip)) is not None:
            raise OutboundRefused(reason)
        return ip

    async def _lookup(self, host: str, port: int) -> list[str]:
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            return list(await self.lookup(host, port))

    async def vet(self, url: str) -> None:
        """The submit-time check: an http(s) URL whose host resolves now, to addresses that all pass."""
        host, port = parse_url(url)
        if self.check_host(host) is not None:
            return
        try:
            addresses = await self._lookup(host, port)
        except (OSError, TimeoutError) as exc:
            raise OutboundRefused(f"{host} does not resolve ({exc or type(exc).__name__})") from None
        if not addresses:
            raise OutboundRefused(f"{host} does not resolve")
        reasons = [r for a in addresses if (r := self.refusal(a, host)) is not None]
        if reasons:
            raise OutboundRefused(
                f"{host} resolves to a refused address: {'; '.join(dict.fromkeys(reasons))}"
            )

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        """The connect-time check: `host`'s addresses the policy allows, resolved now; OutboundRefused when
        none are left. A lookup failure stays an OSError (a connection error, not a refusal)."""
        literal = self.check_host(host)
        if literal is not None:
            return [literal]
        addresses = await self._lookup(host, port)
        allowed: list[IPAddress] = []
        reasons: list[str] = []
        for a in addresses:
            reason = self.refusal(a, host)
            if reason is None:
                allowed.append(_normalize(ipaddress.ip_address(a)))
            else:
                reasons.append(reason)
        if not reasons and not allowed:
            raise OSError(f"{host} does not resolve")
        if not allowed:
            raise OutboundRefused(
                f"{host} resolves to a refused address: {'; '.join(dict.fromkeys(reasons))}"
            )
        return allowed


class GuardResolver(AbstractResolver):
    """aiohttp's resolver for guarded sessions: only the addresses `policy.resolve` allows."""

    def __init__(self, policy: OutboundPolicy) -> None:
        self.policy = policy

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        out: list[ResolveResult] = []
        for ip in await self.policy.resolve(host, port):
            fam = socket.AF_INET if ip.version == 4 else socket.AF_INET6
            if family in (socket.AF_UNSPEC, fam):
                out.append(
                    {"hostname": host, "host": str(ip), "port": port, "family": fam, "proto": 0, "flags": 0}
                )
        if not out:
            raise OutboundRefused(f"{host} has no allowed address of the family asked for")
        return out

    async def close(self) -> None:
        return None


def guarded_session(
    policy: OutboundPolicy, *, connector: dict[str, Any] | None = None, **session: Any
) -> aiohttp.ClientSession:
    """An aiohttp session that can only reach what `policy` allows; `OutboundRefused` when it cannot.

    Names go through `GuardResolver` each time a connection is made; IP literals, which aiohttp connects
    to without resolving, are checked as each request starts. No proxy from the environment is used (it
    would connect on our behalf, unchecked), and callers must not follow redirects.
    """

    async def on_request_start(
        _session: aiohttp.ClientSession, _ctx: SimpleNamespace, params: aiohttp.TraceRequestStartParams
    ) -> None:
        host = params.url.raw_host
        if host is None:
            raise OutboundRefused("the URL has no host")
        policy.check_host(host)

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_request_start)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(resolver=GuardResolver(policy), **(connector or {})),
        trace_configs=[trace],
        trust_env=False,
        **session,
    )
