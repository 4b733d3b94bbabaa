"""A model of vLLM's automatic prefix caching, for benchmarks run against the fake server.

vLLM caches the KV of full blocks of prompt tokens, keyed by a hash chained over every block before it, and
evicts least recently used blocks; a prompt reuses its longest run of cached leading blocks. This keeps the
same chained keys in an LRU of `capacity_blocks`, and counts queried and hit tokens the way vLLM's
`vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` counters do, so a benchmark reads the fake's hit
rate and a real server's from the same `/metrics` lines. A model, not a measurement of vLLM.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self, block: int = 16, capacity_blocks: int = 4096) -> None:
        self.block = block
        self.capacity_blocks = capacity_blocks
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them found cached
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def lookup(self, ids: list[int]) -> int:
        """Cached leading tokens of `ids`; the prompt's full blocks are cached afterwards."""
        hit, chained, cached = 0, 0, True
        for start in range(0, len(ids) - self.block + 1, self.block):
            chained = hash((chained, tuple(ids[start : start + self.block])))
            if cached and chained in self._blocks:
                hit += self.block
                self._blocks.move_to_end(chained)
                continue
            cached = False
            self._blocks[chained] = None
            if len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
        self.queries += len(ids)
        self.hits += hit
        return hit

    def metrics(self, model: str) -> bytes:
        """The two counters in Prometheus text format, named and labelled as vLLM's."""
        labels = f'{{engine="0",model_name="{model}"}}'
        return (
            f"# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{labels} {self.queries}.0\n"
            f"# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{labels} {self.hits}.0\n"
        ).encode()
