"""A deterministic byte-level "tokenizer" over a Qwen-style ChatML rendering, for the fake inference server.

Real servers render chat messages with the model's template and tokenize the result; what matters to the
gateway and to trajectory building is the *shape* of that process, which this reproduces exactly:
- the prompt is `encode(render(messages, tools))`;
- an assistant turn in history renders as `<think>\\n{reasoning}\\n</think>\\n\\n` (when there is reasoning),
  then the content, then one `<tool_call>\\n{"name": ..., "arguments": <arguments text as given>}\\n</tool_call>`
  per call, then `<|im_end|>`; tool results render inside a user turn as `<tool_response>` blocks, as in
  Qwen's template;
- what the model "samples" is `encode(the assistant text exactly as it will appear in the next prompt)` +
  `<|im_end|>`. So a harness that sends history back unchanged gets a next prompt that extends the previous
  prompt plus the sampled tokens, token for token.

Special tokens carry Qwen3's ids; every other byte b is the token `b + BYTE_OFFSET`, so encoding is additive
over concatenation (no BPE merges across a boundary), which is what keeps the prefix property exact.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

BYTE_OFFSET = 1000
CHUNK_BASE = 200_000  # ids of multi-byte tokens (bytes_per_token > 1), above Qwen3's vocabulary
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}
IM_START = SPECIAL_TOKENS["<|im_start|>"]
IM_END = SPECIAL_TOKENS["<|im_end|>"]
_SPECIAL_BY_ID = {v: k for k, v in SPECIAL_TOKENS.items()}
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)


def text_of(content: Any) -> str:
    """A message's text: a string as is, the text parts of a content list joined, None as ''."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise TypeError(f"message content must be a string or a list of parts, not {type(content).__name__}")


def assistant_text(content: str | None, reasoning: str | None, tool_calls: Iterable[tuple[str, str]]) -> str:
    """The assistant turn's text between `<|im_start|>assistant\\n` and `<|im_end|>`."""
    out = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    out += content or ""
    for j, (name, arguments) in enumerate(tool_calls):
        if j or content:
            out += "\n"
        out += '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": ' + arguments + "}\n</tool_call>"
    return out


def _history_calls(message: dict[str, Any]) -> list[tuple[str, str]]:
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments", "")
        calls.append((fn.get("name", ""), args if isinstance(args, str) else json.dumps(args)))
    return calls


class FakeTokenizer:
    """Byte-level ids plus Qwen3's special tokens; `render` is a Qwen-style ChatML template."""

    byte_offset = BYTE_OFFSET
    im_start = IM_START
    im_end = IM_END
    _CACHE_LIMIT = 65536

    def __init__(self, bytes_per_token: int = 1) -> None:
        # Text between special tokens is mostly one message's text, re-sent on every turn of a session: a
        # cache keeps the fake's per-call cost flat as histories grow (benchmarks need it fast).
        self._pieces: dict[str, list[int]] = {}
        self._tokens: dict[int, tuple[str, list[int]]] = {}
        # bytes_per_token > 1 groups each piece's bytes into tokens of that many bytes (ids from CHUNK_BASE,
        # assigned on first sight), so benchmarks see BPE-like id counts; the prefix property still holds
        # because chunking restarts at every special token.
        self.bytes_per_token = bytes_per_token
        self._chunk_ids: dict[bytes, int] = {}
        self._chunks: list[bytes] = []

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._pieces
        for k, piece in enumerate(_SPLIT.split(text)):
            if k % 2:
                out.append(SPECIAL_TOKENS[piece])
            elif piece:
                ids = cache.get(piece)
                if ids is None:
                    if len(cache) >= self._CACHE_LIMIT:
                        cache.clear()
                    ids = cache[piece] = self._encode_piece(piece.encode())
                out += ids
        return out

    def _encode_piece(self, data: bytes) -> list[int]:
        n = self.bytes_per_token
        if n == 1:
            return [b + BYTE_OFFSET for b in data]
        ids = []
        for k in range(0, len(data), n):
            chunk = data[k : k + n]
            i = self._chunk_ids.get(chunk)
            if i is None:
                i = self._chunk_ids[chunk] = CHUNK_BASE + len(self._chunks)
                self._chunks.append(chunk)
            ids.append(i)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                buf.append(i - BYTE_OFFSET)
                continue
            if i >= CHUNK_BASE:
                buf += self._chunks[i - CHUNK_BASE]
                continue
            special = _SPECIAL_BY_ID.get(i)
            if special is None:
                raise ValueError(f"unknown token id {i}")
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            out.append(special)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, i: int) -> bytes:
        if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
            return bytes((i - BYTE_OFFSET,))
        if i >= CHUNK_BASE:
            return self._chunks[i - CHUNK_BASE]
        return _SPECIAL_BY_ID[i].encode()

    def token_info(self, i: int) -> tuple[str, list[int]]:
        """(token text, its bytes) as a logprobs entry shows them; cached, treat as read-only."""
        info = self._tokens.get(i)
        if info is None:
            raw = self.token_bytes(i)
            info = self._tokens[i] = (raw.decode("utf-8", errors="replace"), list(raw))
        return info

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        msgs = list(messages)
        parts: list[str] = []
        if tools:
            system = ""
            if msgs and msgs[0].get("role") == "system":
                system = text_of(msgs.pop(0).get("content")) + "\n\n"
            listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
            parts.append(f"<|im_start|>system\n{system}{_TOOLS_HEAD}{listed}{_TOOLS_TAIL}<|im_end|>\n")
        i = 0
        while i < len(msgs):
            m = msgs[i]
            role = m.get("role")
            if role == "tool":
                # Consecutive tool results share one user turn, as in Qwen's template.
                turn = "<|im_start|>user"
                while i < len(msgs) and msgs[i].get("role") == "tool":
                    turn += "\n<tool_response>\n" + text_of(msgs[i].get("content")) + "\n</tool_response>"
                    i += 1
                parts.append(turn + "<|im_end|>\n")
                continue
            if role == "assistant":
                reasoning = m.get("reasoning_content") or m.get("reasoning")
                body = assistant_text(text_of(m.get("content")), reasoning, _history_calls(m))
                parts.append(f"<|im_start|>assistant\n{body}<|im_end|>\n")
            else:
                parts.append(f"<|im_start|>{role}\n{text_of(m.get('content'))}<|im_end|>\n")
            i += 1
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


def logprob(position: int, token_id: int) -> float:
    """A deterministic negative log-probability, exactly representable (a multiple of 1/256)."""
    return -(((position * 7919 + token_id * 104729) % 1021) + 1) / 256.0
