"""polar.memory (the trainer's polar.train.memory) against the real glibc allocator: freed memory that glibc keeps is given back."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest

from polar import memory

pytestmark = pytest.mark.skipif(memory._libc() is None, reason="needs glibc (mallopt, malloc_trim)")

# Chunks below glibc's mmap threshold come from the heap; keeping every 8th alive pins the heap's top, so
# glibc cannot shrink it by itself: only malloc_trim returns the free pages in between (as after a step).
FRAGMENT = textwrap.dedent(
    """
    import sys
    from polar.train import memory

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    chunks = [bytearray(b"x" * 60_000) for _ in range(4_000)]   # ~240 MB on the heap
    kept = chunks[::8]
    del chunks
    before = rss_mb()
    released = memory.trim() if sys.argv[1] == "trim" else False
    print(released, round(before), round(rss_mb()))
    """
)


def _run(mode: str) -> tuple[bool, float, float]:
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENT, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", float(out[1]), float(out[2])


def test_trim_returns_the_freed_heap_to_the_system() -> None:
    released, before, after = _run("trim")
    assert released
    assert before > 200  # the freed chunks still count: glibc kept them
    assert after < before / 2


def test_without_trim_glibc_keeps_the_freed_heap() -> None:
    # The control: what the trainer's steps did before (the cause of the 5.8 -> 18.5 GB growth).
    released, _, after = _run("keep")
    assert not released and after > 200


def test_limit_arenas_leaves_a_users_setting_alone() -> None:
    # In a child process: the cap is process-wide and would outlive the test here.
    code = "from polar.train import memory; print(memory.limit_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    run = functools.partial(subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True)
    assert run(env=env, check=True).stdout.strip() == "True"
    assert run(env={**env, "MALLOC_ARENA_MAX": "4"}, check=True).stdout.strip() == "False"
