"""vLLM's OpenAI-compatible server (and our embedded engine, which answers in the same shape).

Matched against vLLM's `ChatCompletionResponse` (vllm/entrypoints/openai/chat_completion/protocol.py, the
0.11-0.2x line): with `return_token_ids: true` it adds top-level `prompt_token_ids` and per-choice
`token_ids` (every sampled id, the end-of-turn token included); `logprobs: true, top_logprobs: 0` gives one
`logprobs.content[i].logprob` per sampled token. vLLM must run with `--logprobs-mode processed_logprobs` for
those to be the distribution actually sampled from (the gateway cannot check that from here).

Reasoning comes as `message.reasoning` (vLLM PR #27752, late 2025; `reasoning_content` was dropped by PR
#33402) or `message.reasoning_content` (older vLLM).
Our embedded engine adds top-level `policy_version` (int) and `polar_flags` (list of str, also per choice).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from polar.gateway.backends.base import float_list, id_sequence, int_list
from polar.gateway.backends.http import Decoder
from polar.gateway.backends.openai import TokenData, TokenizingBackend
from polar.gateway.backends.prompt_ids import IdsMemo, decode_answer
from polar.jsontypes import JSON


class VLLMBackend(TokenizingBackend):
    kind = "vllm"

    def training_fields(self) -> dict[str, Any]:
        return {"return_token_ids": True, "logprobs": True, "top_logprobs": 0}

    def decoder(self, memo: IdsMemo | None) -> Decoder:
        """Top-level `prompt_token_ids` decoded into `TokenIds`, only the part the session's previous prompt
        did not have (`polar.gateway.backends.prompt_ids`); without a memo, all of them."""
        return partial(decode_answer, memo=memo)

    def read_tokens(self, data: dict[str, Any], choice: dict[str, Any]) -> TokenData:
        tokens = TokenData(
            prompt_ids=id_sequence(data.get("prompt_token_ids")),
            response_ids=int_list(choice.get("token_ids")),
            logprobs=_logprobs(choice.get("logprobs")),
            text=_token_text(choice.get("logprobs")),
        )
        version = data.get("policy_version")
        if type(version) is int:
            tokens.policy_version = version
        # The engine reports flags per choice and their union at the top; the gateway reads choice 0.
        for flags in (choice.get("polar_flags"), data.get("polar_flags")):
            if isinstance(flags, list):
                tokens.flags += [f for f in flags if isinstance(f, str) and f not in tokens.flags]
        return tokens


def _token_text(value: JSON) -> str | None:
    """The sampled tokens' text, `logprobs.content[].token` joined: what the model wrote, markup a tool
    parser took or gave up on included (`polar.gateway.toolcheck`); None when absent."""
    content = value.get("content") if isinstance(value, dict) else None
    if type(content) is not list:
        return None
    try:  # an entry that is not an object, or a token that is missing or not a string, raises: None
        return "".join([entry["token"] for entry in content])
    except (TypeError, KeyError):
        return None


def _logprobs(value: JSON) -> list[float] | None:
    """`logprobs.content[].logprob` as floats; None when absent or malformed (flagged, not repaired)."""
    content = value.get("content") if isinstance(value, dict) else None
    if type(content) is not list:
        return None
    try:
        raw = [entry["logprob"] for entry in content]
    except (TypeError, KeyError):
        return None
    return float_list(raw)
