"""A vLLM logits processor that makes the real server write a scripted answer, token by token.

Loaded into `vllm serve` (`--logits-processors forced_tokens:ForcedTokens`, this folder on its PYTHONPATH;
it imports nothing of polar, which is not in vLLM's venv). A request that carries
`vllm_xargs: {"polar_forced": [token ids]}` samples exactly those ids, one per step: every other logit is
-inf. Requests without it are left alone.

Why: no model that runs on two CPU cores drives a coding agent through thirty tool calls, and a scripted
policy is what the depth benchmark needs. Forcing the tokens keeps everything else real: vLLM renders the
CLI's conversation with the model's chat template and tokenizes it, its hermes parser turns the forced
`<tool_call>` text into tool calls, and it returns its own token ids and logprobs, prefix cache included.
Differences from a model that chose those tokens: each forced token's processed logprob is 0.0 (probability
1), and generation stops at the forced `<|im_end|>` (a stop token), not at a choice of the model.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

KEY = "polar_forced"


class ForcedTokens(AdapterLogitsProcessor):
    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        forced = (params.extra_args or {}).get(KEY)
        if forced is not None and (
            not isinstance(forced, list) or not all(isinstance(t, int) and t >= 0 for t in forced)
        ):
            raise ValueError(f"vllm_xargs.{KEY} must be a list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is the most likely

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        forced = (params.extra_args or {}).get(KEY)
        if not forced:
            return None
        ids = [int(t) for t in forced]

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step >= len(ids):
                return logits  # past the script (a stop token ends it first): the model's own choice
            out = torch.full_like(logits, float("-inf"))
            out[ids[step]] = 0.0
            return out

        return force
