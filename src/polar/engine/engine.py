"""The embedded engine: a model, its batching scheduler, and the parsers that read its output.

Use it over HTTP (`polar serve-model`, `polar.engine.app.create_engine_app`) or in process: a trainer on
the same machine calls `update_weights(model.state_dict())` between steps and every later generation
reports the new `policy_version`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from polar.chat.tool_parsers import ToolParser, detect_parser, get_parser
from polar.engine.loader import LoadedModel, load_model
from polar.engine.sampling import SamplingParams
from polar.engine.scheduler import Scheduler, SeqUpdate
from polar.engine.weights import load_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The tiny default model never emits <|im_end|>: without a cap a request without max_tokens would run to
# the end of its 32k context.
TINY_DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs. `default_max_tokens` caps chat requests that send none (None: rest of context)."""

    max_num_seqs: int = 16
    prefill_chunk: int = 512
    prefix_cache_gb: float = 1.0
    default_max_tokens: int | None = None
    tool_call_parser: str | None = "auto"
    reasoning_parser: str | None = "auto"
    trust_request_chat_template: bool = False


class Engine:
    """One served model. Thread-safe; `generate` is async and may be called from any event loop."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(
            loaded,
            max_num_seqs=self.config.max_num_seqs,
            prefill_chunk=self.config.prefill_chunk,
            prefix_cache_bytes=int(self.config.prefix_cache_gb * (1 << 30)),
        )
        template = getattr(loaded.tokenizer, "chat_template", None)
        self.chat_template: str | None = template if isinstance(template, str) else None
        name = self.config.tool_call_parser
        self.tool_parser: ToolParser | None = (
            detect_parser(self.chat_template) if name == "auto" else get_parser(name) if name else None
        )
        rname = self.config.reasoning_parser
        if rname == "auto":
            vocab = loaded.tokenizer.get_vocab()
            self.reasoning = "<think>" in vocab and "</think>" in vocab
        elif rname in (None, "none"):
            self.reasoning = False
        elif rname in ("qwen3", "deepseek_r1", "think"):
            self.reasoning = True
        else:
            raise ValueError(f"unknown reasoning parser {rname!r}; use qwen3, deepseek_r1 or none")
        default = self.config.default_max_tokens
        if default is None and loaded.is_default_tiny:
            default = TINY_DEFAULT_MAX_TOKENS
        self.default_max_tokens = default

    @classmethod
    def load(
        cls,
        model: str | None = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        served_name: str | None = None,
        config: EngineConfig | None = None,
        start: bool = True,
    ) -> Engine:
        loaded = load_model(
            model, device=device, dtype=dtype, max_model_len=max_model_len, served_name=served_name
        )
        engine = cls(loaded, config)
        if start:
            engine.start()
        return engine

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> Engine:
        self.scheduler.start()
        return self

    def stop(self) -> None:
        self.scheduler.stop()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- facts --------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.loaded.tokenizer

    @property
    def model(self) -> PreTrainedModel:
        return self.loaded.model

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    @property
    def policy_version(self) -> int:
        return self.scheduler.policy_version

    # ---- generation ---------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[SeqUpdate]:
        """Yield one update per sampled token until the sequence finishes (or the caller stops)."""
        rid = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[SeqUpdate] = asyncio.Queue()

        def emit(update: SeqUpdate) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, update)

        self.scheduler.submit(rid, prompt_ids, params, emit)
        finished = False
        try:
            while True:
                update = await queue.get()
                finished = update.finish_reason is not None
                yield update
                if finished:
                    return
        finally:
            if not finished:
                self.scheduler.abort(rid)

    # ---- weights ------------------------------------------------------------------------------------

    def update_weights(
        self,
        weights: Mapping[str, torch.Tensor] | str | Path,
        policy_version: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Swap weights from a state dict or a checkpoint folder; blocks until in-flight work drained.

        Returns the new policy version (`policy_version` when given, else the old one + 1).
        """
        source: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]
        if isinstance(weights, (str, Path)):
            path = weights
            source = lambda: load_checkpoint(path)  # noqa: E731 - read on the engine thread, after draining
        else:
            source = weights
        return self.scheduler.update_weights(source, policy_version).result(timeout)

    async def update_weights_async(
        self, weights: Mapping[str, torch.Tensor] | str | Path, policy_version: int | None = None
    ) -> int:
        return await asyncio.to_thread(self.update_weights, weights, policy_version)
