"""The embedded inference engine: a vLLM-compatible policy server on transformers + torch.

`Engine` serves one causal LM with continuous batching, a prefix cache, processed logprobs, tool-call and
reasoning parsing, and in-place weight updates; `create_engine_app` puts it behind vLLM's HTTP API.
Importing this package imports torch.
"""

from polar.engine.app import create_engine_app
from polar.engine.engine import Engine, EngineConfig
from polar.engine.loader import LoadedModel, load_model
from polar.engine.sampling import SamplingParams
from polar.engine.scheduler import SeqUpdate

__all__ = [
    "Engine",
    "EngineConfig",
    "LoadedModel",
    "SamplingParams",
    "SeqUpdate",
    "create_engine_app",
    "load_model",
]
