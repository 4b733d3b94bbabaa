"""The runtime table: each backend's name, what it needs on this machine, and how it is built.

Every place that knows runtime names reads them here (`RUNTIMES`, a closed `polar.plugins.Registry` as the
gateway's dialects are), built from `RuntimeBackend`'s names and each runtime module's `RUNTIME` entry: a
new runtime is its module plus its name in that list.
`check_runtime` refuses early (at node admission and before `polar run` starts anything) a backend that
cannot run on this machine or cannot confine the network it asks for; `default_backend` is what a
task that names no runtime gets: the strongest isolation this machine has.
"""

from __future__ import annotations

from typing import get_args

from polar import plugins
from polar.runtime.base import Runtime, RuntimeBackend, RuntimeEntry, RuntimeFailure, RuntimeSpec
from polar.runtime.local import Keep

RUNTIMES = plugins.Registry[RuntimeEntry](
    "runtime", {name: f"polar.runtime.{name}:RUNTIME" for name in get_args(RuntimeBackend)}, closed=True
)
_ENTRIES = RUNTIMES.entries()
BACKENDS = tuple(_ENTRIES)
IMAGE_BACKENDS = tuple(name for name, entry in _ENTRIES.items() if entry.image)
CONTAINER_BACKENDS = IMAGE_BACKENDS  # kept for callers that say "container"


def default_backend() -> RuntimeBackend:
    """What a task that names no runtime gets: bwrap, the strongest isolation that needs no image; a clear
    error where it cannot run (nothing weaker is chosen silently)."""
    from polar.runtime.bwrap import probe

    why = probe()
    if why is not None:
        raise RuntimeFailure(
            f"the task names no runtime and the default sandbox, bwrap, cannot run here: {why}. Install "
            "bubblewrap, or name one in the task: runtime.backend 'docker' or 'podman' with an image, or "
            "'local' for a policy you trust with this machine's files (docs/security.md)"
        )
    return "bwrap"


def check_runtime(spec: RuntimeSpec) -> None:
    """Raise `RuntimeFailure` saying what is missing when `spec` cannot run here; None when it can."""
    entry = _ENTRIES.get(spec.backend)
    if entry is None:
        raise RuntimeFailure(f"unknown runtime backend {spec.backend!r}; known: {', '.join(BACKENDS)}")
    if entry.image and not spec.image:
        raise RuntimeFailure(f"runtime {spec.backend!r} needs runtime.image")
    entry.check(spec)
    for name, value in (("cpus", spec.cpus), ("memory_mb", spec.memory_mb), ("pids_limit", spec.pids_limit)):
        if value is not None and not entry.limits:
            limited = " and ".join(n for n, e in _ENTRIES.items() if e.limits)
            raise RuntimeFailure(f"runtime.{name} is enforced by {limited} only, not {spec.backend!r}")


def make_runtime(
    spec: RuntimeSpec,
    session_id: str,
    *,
    gateway_url: str | None = None,
    keep: Keep = "nothing",
) -> Runtime:
    """A new, not yet started runtime for one session (or one evaluation).

    `gateway_url` is the gateway as the host reaches it; sandboxes that isolate the network make it
    reachable inside and publish the URL to hand the harness as `runtime.gateway_url`.
    """
    check_runtime(spec)
    entry = _ENTRIES[spec.backend]
    runtime: Runtime = entry.cls(spec, session_id, gateway_url=gateway_url, keep=keep, **entry.extra())
    return runtime
