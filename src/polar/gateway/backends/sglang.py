"""SGLang's OpenAI-compatible chat endpoint, asked for prompt ids and per-token sampled ids and logprobs.

Matched against SGLang main of mid-2026 (python/sglang/srt/entrypoints/openai/protocol.py at commit
004c82e0, serving_chat.py `_build_chat_response`):
- `return_prompt_token_ids: true` puts the prompt ids on each choice: `choices[i].prompt_token_ids`;
- `return_meta_info: true` attaches the engine's `meta_info` to each choice, and with `logprobs: true` it
  holds `output_token_logprobs`: one `[logprob, token_id, text]` per sampled token (the text is null unless
  asked for), so sampled ids and their logprobs come from one list and cannot disagree in length;
- `metadata.weight_version` names the weights that sampled (a string; a numeric one is the policy version).
SGLang refuses these fields on streaming requests, so a streamed harness request is answered from one
non-streamed upstream call (`streams = False`: `stream()` yields the whole answer as one chunk), and the
harness gets its stream only once the answer is complete.

SGLang answers `content: ""` rather than null when the model wrote no text (so that re-tokenizing the message
is stable); here that becomes None like every other backend.
"""

from __future__ import annotations

from typing import Any

from polar.gateway.backends.base import float_list, int_list, text_field
from polar.gateway.backends.openai import TokenData, TokenizingBackend


class SGLangBackend(TokenizingBackend):
    kind = "sglang"
    streams = False

    def training_fields(self) -> dict[str, Any]:
        return {
            "return_prompt_token_ids": True,
            "return_meta_info": True,
            "logprobs": True,
            "top_logprobs": 0,
        }

    def read_content(self, message: dict[str, Any]) -> str | None:
        return text_field(message, "content") or None

    def read_tokens(self, data: dict[str, Any], choice: dict[str, Any]) -> TokenData:
        tokens = TokenData(prompt_ids=int_list(choice.get("prompt_token_ids")))
        meta = choice.get("meta_info")
        entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
        if type(entries) is list:
            try:
                ids = [e[1] for e in entries]
                lps = [e[0] for e in entries]
            except (TypeError, IndexError, KeyError):
                pass
            else:
                tokens.response_ids = int_list(ids)
                tokens.logprobs = float_list(lps)
        metadata = data.get("metadata")
        version = metadata.get("weight_version") if isinstance(metadata, dict) else None
        if type(version) is int:
            tokens.policy_version = version
        elif isinstance(version, str) and version.isdigit():
            tokens.policy_version = int(version)
        return tokens
