"""Giving freed memory back to the system, where glibc's allocator would keep it.

glibc gives every thread its own arena (up to 8 per core) and keeps freed chunks in them: a process that
allocated gigabytes from threads and freed them stays that large. The trainer (`polar.train.memory`: each
step's logits and gradients) and the gateway (a burst of sessions whose records were written from the
writer thread, then evicted when idle) call `trim` once the memory is free, and the trainer caps its
arenas before its threads allocate; gateway processes fix glibc's mmap and trim thresholds, without which a
thread's arena keeps what it freed out of trim's reach. All are no-ops off glibc (musl, macOS); settings
the user made in the environment are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Any

log = logging.getLogger("polar")

M_ARENA_MAX = -8  # glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
ARENAS = 2
# glibc's own starting values. Setting them fixes them: glibc otherwise raises both each time a large
# (mmapped) chunk is freed, up to 32 MiB and 64 MiB.
MMAP_THRESHOLD = TRIM_THRESHOLD = 128 << 10


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


def fix_thresholds() -> bool:
    """Keep glibc's mmap and trim thresholds at 128 KiB for this process: True if set, False off glibc or
    when the environment already says (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES).

    A gateway frees a 60k-token session's bodies (~250 kB each) after every call; glibc then raises its
    thresholds to that size, so later ones come from the heaps, and a thread arena (the record writer's)
    keeps a free top of up to twice the threshold that `malloc_trim` never returns (it trims only the
    main arena's top: glibc 2.36 malloc.c, mtrim). Fixed, a large block is mapped and unmapped on its own
    and a freed top over 128 KiB is returned as it is freed (bench/soak.py, docs/benchmarks.md)."""
    libc = _libc()
    if libc is None or any(
        k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
    ):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def rss_bytes() -> int:
    """This process's resident memory now (Linux; 0 elsewhere): what a release gives back is read here."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# A gateway call allocates a few thousand container objects (parsed bodies, records, pydantic models) that
# die with the call; CPython's default first-generation threshold (700) runs a collection every few calls,
# and each full collection walks everything the process imported. Measured with bench/gateway_cpu.py
# (docs/benchmarks.md, "Garbage collection in the gateway"): about 9 % less CPU per call, p99 34 -> 20 ms
# at concurrency 16.
GC_THRESHOLDS = (50_000, 50, 100)


def tune_gc() -> None:
    """For a process that serves the gateway: move what start-up made (modules, apps, config) out of the
    collector's reach (`gc.freeze`) and collect the young generation per 50,000 allocations instead of 700;
    and fix glibc's thresholds (`fix_thresholds`), so memory a burst of sessions used can be given back.
    Call once, after start-up and before serving; never in a test process (it is global)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    fix_thresholds()
