"""polar.memory.fix_thresholds against the real glibc allocator: what a thread frees comes back to the system.

The gateway's record writer is a thread with its own glibc arena. After glibc raised its thresholds (a large
mmapped block was freed, as every 60k-token body is), the blocks a thread frees stay in its arena's top,
which `malloc_trim` does not return; with the thresholds fixed they go back as they are freed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from polar import memory

pytestmark = pytest.mark.skipif(memory._libc() is None, reason="needs glibc (mallopt, malloc_trim)")

THREAD_BURST = textwrap.dedent(
    """
    import sys, threading
    from polar import memory

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    fixed = memory.fix_thresholds() if sys.argv[1] == "fixed" else False

    def burst():
        big = b"x" * (16 << 20)  # freed: glibc raises its mmap threshold to 16 MiB, its trim threshold to 32
        del big
        chunks = [b"y" * 200_000 + bytes([i % 256]) for i in range(120)]  # ~24 MB from this thread's arena
        del chunks

    before = rss_mb()
    t = threading.Thread(target=burst)
    t.start()
    t.join()
    memory.trim()
    print(fixed, round(rss_mb() - before))
    """
)


def _held_mb(mode: str, env: dict[str, str] | None = None) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", THREAD_BURST, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    ).stdout.split()
    return out[0] == "True", int(out[1])


def test_fixed_thresholds_give_back_what_a_thread_freed() -> None:
    fixed, held = _held_mb("fixed")
    assert fixed
    assert held < 8


def test_without_them_a_threads_arena_keeps_it_even_after_trim() -> None:
    # The control: the gateway's writer thread before (bench/soak.py: up to 14 MiB held in its arena).
    fixed, held = _held_mb("dynamic")
    assert not fixed and held > 16


def test_a_threshold_set_in_the_environment_is_left_alone() -> None:
    # The user's choice (large blocks from the heaps, a 64 MiB trim threshold) holds: nothing is fixed over it.
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
    fixed, held = _held_mb("fixed", env)
    assert not fixed and held > 16
