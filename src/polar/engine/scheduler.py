"""Continuous batching on one model, in one background thread.

Each loop iteration runs at most one prefill chunk (one new sequence, `prefill_chunk` prompt tokens at a
time, so a long agent prompt does not freeze the others) and then one decode step for every running
sequence together. Sequences join the batch as soon as their prefill ends and leave the moment they finish,
so concurrent requests share forward passes without waiting for each other.

Weight updates drain: once an update is requested no new sequence is admitted, the running ones finish on
the old weights, then the weights are swapped, `policy_version` moves on and the prefix cache (keys/values
of the old weights) is dropped. Every token of a sequence therefore comes from the one version it reports.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from polar.engine.detok import IncrementalDetokenizer
from polar.engine.kvcache import BatchKV, PrefixCache, get_kv, make_cache
from polar.engine.loader import LoadedModel
from polar.engine.sampling import SamplingParams, make_generator, sample
from polar.engine.weights import apply_state_dict

if TYPE_CHECKING:
    from transformers import DynamicCache

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SeqUpdate:
    """What one sequence produced in one step (a single token), plus how it ended when it did."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    policy_version: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class _Seq:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[SeqUpdate], None]
    detok: IncrementalDetokenizer
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    cache: DynamicCache | None = None
    kv_len: int = 0
    cached_tokens: int = 0
    next_token: int = -1
    version: int = 0
    done: bool = False


@dataclass
class _Update:
    state: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]
    version: int | None
    future: Future[int]


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_chunks: int = 0
    generated_tokens: int = 0
    max_batch: int = 0
    batched_steps: int = 0


class Scheduler:
    """Owns the model: only its thread runs forward passes or touches the weights."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_num_seqs: int = 16,
        prefill_chunk: int = 512,
        prefix_cache_bytes: int = 1 << 30,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.policy_version = 0
        self.stats = SchedulerStats()
        self._cv = threading.Condition()
        self._waiting: deque[_Seq] = deque()
        self._prefilling: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._batch = BatchKV()
        self._aborts: set[str] = set()
        self._updates: deque[_Update] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        params = inspect.signature(self.model.forward).parameters
        # transformers 5.2x renamed `past_key_values` to `cache` (the old name still works, with a warning).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)

    # ---- called from any thread -------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="polar-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Callable[[SeqUpdate], None],
    ) -> None:
        detok = IncrementalDetokenizer(
            self.loaded.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        seq = _Seq(request_id, list(prompt_ids), params, emit, detok, make_generator(params.seed))
        with self._cv:
            self._waiting.append(seq)
            self._cv.notify_all()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify_all()

    def update_weights(
        self,
        state: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]],
        version: int | None = None,
    ) -> Future[int]:
        """Queue a drain-then-swap; the future resolves to the new policy version (or the error)."""
        fut: Future[int] = Future()
        with self._cv:
            if self._thread is None:
                self._apply_update(_Update(state, version, fut))
                return fut
            self._updates.append(_Update(state, version, fut))
            self._cv.notify_all()
        return fut

    @property
    def load(self) -> dict[str, int]:
        with self._cv:
            return {
                "waiting": len(self._waiting),
                "prefilling": len(self._prefilling),
                "running": len(self._running),
            }

    # ---- the engine thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (
                    self._stopping or self._waiting or self._prefilling or self._running or self._updates
                ):
                    self._cv.wait()
                if self._stopping:
                    break
                aborts, self._aborts = self._aborts, set()
                if not self._updates:
                    while self._waiting and len(self._prefilling) + len(self._running) < self.max_num_seqs:
                        seq = self._waiting.popleft()
                        seq.version = self.policy_version
                        self._prefilling.append(seq)
                pending_update = self._updates[0] if self._updates else None
            try:
                if aborts:
                    self._abort(aborts)
                if pending_update is not None and not self._prefilling and not self._running:
                    with self._cv:
                        self._updates.popleft()
                    self._apply_update(pending_update)
                    continue
                with torch.inference_mode():
                    if self._prefilling:
                        self._prefill_step()
                    if self._running:
                        self._decode_step()
            except Exception as exc:  # a failed forward must not kill the server: fail what was in flight
                log.exception("engine step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
        self._fail_all("engine stopped")

    def _apply_update(self, upd: _Update) -> None:
        try:
            state = upd.state() if callable(upd.state) else upd.state
            apply_state_dict(self.model, state)
        except Exception as exc:
            upd.future.set_exception(exc)
            return
        self.policy_version = upd.version if upd.version is not None else self.policy_version + 1
        self.prefix_cache.clear()
        upd.future.set_result(self.policy_version)

    def _forward(self, input_ids: torch.Tensor, cache: DynamicCache | None, **kw: Any) -> torch.Tensor:
        kw[self._cache_kw] = cache
        if self._keep_kw is not None:
            kw[self._keep_kw] = 1
        out = self.model(input_ids=input_ids.to(self.loaded.device), use_cache=True, **kw)
        return cast(torch.Tensor, out.logits[:, -1, :])

    def _prefill_step(self) -> None:
        seq = self._prefilling[0]
        if seq.cache is None:
            hit, kv = self.prefix_cache.lookup(seq.prompt_ids)
            seq.cache = make_cache(kv)
            seq.kv_len = seq.cached_tokens = hit
        chunk = seq.prompt_ids[seq.kv_len : seq.kv_len + self.prefill_chunk]
        start = seq.kv_len
        pos = torch.arange(start, start + len(chunk), device=self.loaded.device).unsqueeze(0)
        logits = self._forward(torch.tensor([chunk]), seq.cache, position_ids=pos)
        seq.kv_len += len(chunk)
        self.stats.prefill_chunks += 1
        if seq.kv_len < len(seq.prompt_ids):
            return
        self._prefilling.popleft()
        self.prefix_cache.insert(seq.prompt_ids, get_kv(seq.cache))
        self._sample([seq], logits)
        if seq.done:
            seq.cache = None
            return
        self._batch.add(seq.cache, seq.kv_len)
        seq.cache = None
        self._running.append(seq)

    def _decode_step(self) -> None:
        seqs = self._running
        ids = torch.tensor([[s.next_token] for s in seqs])
        pos = torch.tensor([[s.kv_len] for s in seqs], device=self.loaded.device)
        mask = self._batch.grow()
        logits = self._forward(ids, self._batch.cache, attention_mask=mask, position_ids=pos)
        for s in seqs:
            s.kv_len += 1
        self.stats.steps += 1
        self.stats.max_batch = max(self.stats.max_batch, len(seqs))
        if len(seqs) > 1:
            self.stats.batched_steps += 1
        self._sample(seqs, logits)
        if any(s.done for s in seqs):
            keep = []
            for row, s in enumerate(seqs):
                if s.done:
                    # Keep prompt + output (all but the last token, which is not in the cache yet).
                    n = s.kv_len
                    self.prefix_cache.insert((s.prompt_ids + s.output_ids)[:n], self._batch.row(row, n))
                else:
                    keep.append(row)
            self._batch.keep(keep)
            self._running = [seqs[r] for r in keep]

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        eos = self.loaded.eos_token_ids
        banned: list[tuple[int, ...]] = []
        for s in seqs:
            p = s.params
            if len(s.output_ids) < p.min_tokens:
                banned.append(tuple(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))))
            else:
                banned.append(())
        out = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], banned)
        limit = self.loaded.max_model_len
        for i, s in enumerate(seqs):
            tok = out.token_ids[i]
            p = s.params
            s.output_ids.append(tok)
            s.next_token = tok
            finish: str | None = None
            stop_reason: int | str | None = None
            # A stop token is sampled (its id and logprob are reported) but, as in vLLM, not part of the text.
            if tok in p.stop_token_ids:
                finish, stop_reason = "stop", tok
            elif tok in eos and not p.ignore_eos:
                finish = "stop"
            else:
                s.detok.add(tok)
            if finish is None and s.detok.stop_hit is not None:
                finish, stop_reason = "stop", s.detok.stop_hit
            elif finish is None and (
                len(s.output_ids) >= p.max_tokens or len(s.prompt_ids) + len(s.output_ids) >= limit
            ):
                finish = "length"
            if finish is not None:
                s.done = True
                s.detok.flush()
            self.stats.generated_tokens += 1
            s.emit(
                SeqUpdate(
                    token_ids=[tok],
                    logprobs=[out.logprobs[i]],
                    top=[out.top[i]] if out.top is not None else None,
                    text=s.detok.take(final=s.done),
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    policy_version=s.version,
                    cached_tokens=s.cached_tokens,
                )
            )

    def _abort(self, ids: set[str]) -> None:
        with self._cv:
            self._waiting = deque(s for s in self._waiting if s.request_id not in ids)
        self._prefilling = deque(s for s in self._prefilling if s.request_id not in ids)
        keep = [r for r, s in enumerate(self._running) if s.request_id not in ids]
        if len(keep) != len(self._running):
            self._batch.keep(keep)
            self._running = [self._running[r] for r in keep]

    def _fail_all(self, message: str) -> None:
        with self._cv:
            victims = list(self._waiting) if self._stopping else []
            if self._stopping:
                self._waiting.clear()
        victims += list(self._prefilling) + self._running
        self._prefilling.clear()
        self._running = []
        self._batch = BatchKV()
        for s in victims:
            s.done = True
            s.emit(
                SeqUpdate([], [], None, "", finish_reason="error", policy_version=s.version, error=message)
            )
