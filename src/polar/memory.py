"""Giving freed memory back to the system, where glibc's allocator would keep it.

glibc gives every thread its own arena (up to 8 per core) and keeps freed chunks in them: a process that
allocated gigabytes from threads and freed them stays that large. The trainer (`polar.train.memory`: each
step's logits and gradients) and the gateway (a burst of sessions whose records were written from the
writer thread, then evicted when idle) call `trim` once the memory is free, and the trainer caps its
arenas before its threads allocate. Both are no-ops off glibc (musl, macOS); a `MALLOC_ARENA_MAX` the user
set is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Any

log = logging.getLogger("polar")

M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
ARENAS = 2


@functools.cache
def _libc() -> Any | None:
    """glibc, if this process runs on it (the functions below need `mallopt` and `malloc_trim`)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    return libc


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas for this process (before the trainer's threads allocate): True if set,
    False off glibc or when the environment already says (`MALLOC_ARENA_MAX`)."""
    libc = _libc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    ok = bool(libc.mallopt(M_ARENA_MAX, arenas))
    if ok:
        log.debug("malloc arenas capped at %d", arenas)
    return ok


def trim() -> bool:
    """Give the freed memory of every arena back to the system: True if some was released."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


# A gateway call allocates a few thousand container objects (parsed bodies, records, pydantic models) that
# die with the call; CPython's default first-generation threshold (700) runs a collection every few calls,
# and each full collection walks everything the process imported. Measured with bench/gateway_cpu.py
# (docs/benchmarks.md, "Garbage collection in the gateway"): about 9 % less CPU per call, p99 34 -> 20 ms
# at concurrency 16.
GC_THRESHOLDS = (50_000, 50, 100)


def tune_gc() -> None:
    """For a process that serves the gateway: move what start-up made (modules, apps, config) out of the
    collector's reach (`gc.freeze`) and collect the young generation per 50,000 allocations instead of 700.
    Call once, after start-up and before serving; never in a test process (it is global)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
