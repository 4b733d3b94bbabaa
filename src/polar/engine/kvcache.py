"""Key/value caches for dynamic batching, and a prefix cache across calls.

Running sequences share one left-padded transformers `DynamicCache` ([B, heads, T, dim] per layer) plus a
[B, T] attention mask; a sequence joins by left-padding whichever side is shorter and leaves by row
selection. The per-layer tensors are edited directly (`layer.keys`/`layer.values` in transformers >= 5,
`key_cache`/`value_cache` lists before), which is why only plain attention caches are supported.

The prefix cache keeps the keys/values of recent prompts (and finished outputs) keyed by their token ids;
agent sessions resend the same growing prefix each turn, so the next call prefills only what is new.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

KV = list[tuple[torch.Tensor, torch.Tensor]]

# `get_kv`/`set_kv` take a DynamicCache of any transformers version: `layers` of keys and values (>= 5)
# or `key_cache`/`value_cache` lists (< 5); typed Any, as the installed version's stubs know only one.


def get_kv(cache: Any) -> KV:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # transformers < 5


def set_kv(cache: Any, kv: KV) -> None:
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.keys, layer.values = k, v
    else:
        cache.key_cache = [k for k, _ in kv]
        cache.value_cache = [v for _, v in kv]


def make_cache(kv: KV | None = None) -> DynamicCache:
    """A DynamicCache holding `kv` as is (no copy); empty when `kv` is None."""
    cache = DynamicCache()
    if not kv:
        return cache
    if hasattr(cache, "layers"):
        from transformers.cache_utils import DynamicLayer

        layers: list[Any] = []
        for k, v in kv:
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            layers.append(layer)
        cache.layers = layers
    else:
        set_kv(cache, kv)
    return cache


def _pad_left(x: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[-2] = n
    return torch.cat([x.new_zeros(shape), x], dim=-2)


@dataclass
class BatchKV:
    """The running batch's cache and mask; row i belongs to the i-th running sequence."""

    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def add(self, seq_cache: DynamicCache, length: int) -> None:
        """Append one sequence whose cache holds exactly `length` positions (no padding)."""
        seq_kv = get_kv(seq_cache)
        device = seq_kv[0][0].device
        if self.cache is None or self.mask is None:
            self.cache = seq_cache
            self.mask = torch.ones(1, length, dtype=torch.long, device=device)
            return
        width = max(self.width, length)
        merged = [
            (
                torch.cat([_pad_left(bk, width - self.width), _pad_left(sk, width - length)], dim=0),
                torch.cat([_pad_left(bv, width - self.width), _pad_left(sv, width - length)], dim=0),
            )
            for (bk, bv), (sk, sv) in zip(get_kv(self.cache), seq_kv, strict=True)
        ]
        set_kv(self.cache, merged)
        row = torch.zeros(1, width, dtype=torch.long, device=device)
        row[:, width - length :] = 1
        old = self.mask
        if width > self.width:
            old = torch.cat([old.new_zeros(old.shape[0], width - self.width), old], dim=1)
        self.mask = torch.cat([old, row], dim=0)

    def grow(self) -> torch.Tensor:
        """Extend the mask by the position the next decode step writes; returns the mask to pass."""
        assert self.mask is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], dim=1)
        return self.mask

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order) and drop left columns that are padding in every kept row."""
        if not rows:
            self.cache, self.mask = None, None
            return
        assert self.mask is not None
        if rows == list(range(self.size)):
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        used = torch.nonzero(mask.any(dim=0)).flatten()
        start = int(used[0]) if used.numel() else mask.shape[1]
        self.mask = mask[:, start:]
        set_kv(
            self.cache,
            [
                (k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:])
                for k, v in get_kv(self.cache)
            ],
        )

    def row(self, index: int, length: int) -> KV:
        """A copy of one row's last `length` positions (its real tokens), for the prefix cache."""
        return [
            (k[index : index + 1, :, -length:].clone(), v[index : index + 1, :, -length:].clone())
            for k, v in get_kv(self.cache)
        ]


@dataclass
class _Entry:
    ids: np.ndarray
    kv: KV
    nbytes: int


@dataclass
class PrefixCache:
    """LRU of (token ids -> keys/values) bounded in bytes; lookups use the longest common prefix."""

    max_bytes: int
    entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)
    nbytes: int = 0
    hits: int = 0
    hit_tokens: int = 0
    _next: int = 0

    def lookup(self, ids: list[int]) -> tuple[int, KV | None]:
        """Longest cached prefix of `ids`, capped at len(ids) - 1 so one token is left to compute logits."""
        if not self.entries or len(ids) < 2:
            return 0, None
        query = np.asarray(ids, dtype=np.int64)
        best, best_key = 0, None
        for key, entry in self.entries.items():
            n = _common_prefix(entry.ids, query)
            if n > best:
                best, best_key = n, key
        best = min(best, len(ids) - 1)
        if best_key is None or best == 0:
            return 0, None
        entry = self.entries[best_key]
        self.entries.move_to_end(best_key)
        self.hits += 1
        self.hit_tokens += best
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in entry.kv]

    def insert(self, ids: list[int], kv: KV) -> None:
        if self.max_bytes <= 0 or not ids:
            return
        arr = np.asarray(ids, dtype=np.int64)
        for key, entry in list(self.entries.items()):
            n = _common_prefix(entry.ids, arr)
            if n == len(arr):  # already covered by a longer (or equal) entry
                self.entries.move_to_end(key)
                return
            if n == len(entry.ids):  # the old entry is a prefix of the new one
                self._drop(key)
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if size > self.max_bytes:
            return
        self.entries[self._next] = _Entry(arr, kv, size)
        self._next += 1
        self.nbytes += size
        while self.nbytes > self.max_bytes and self.entries:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m
