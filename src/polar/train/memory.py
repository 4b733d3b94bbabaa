"""Keep the trainer's resident memory at what it uses, not at what glibc's allocator holds on to.

Measured on Gemma 3 270M, full fine-tuning on CPU (bench/train_memory.py, docs/benchmarks.md): each step
allocates and frees gigabytes (logits over a 262k vocabulary, gradients, the safetensors written for the
weight sync) from threads (`asyncio.to_thread`). glibc gives every thread its own arena, up to 8 per core,
and keeps freed chunks in them, so the process grew from 5.8 to 18.5 GB in 8 steps and the machine
thrashed, while the live tensors stayed near 4 GB. Two arenas and a `malloc_trim` after each step keep it
at about 4 GB between steps.

The helpers are `polar.memory`'s, which the gateway uses too.
"""

from __future__ import annotations

from polar.memory import ARENAS, M_ARENA_MAX, limit_arenas, trim

__all__ = ["ARENAS", "M_ARENA_MAX", "limit_arenas", "trim"]
