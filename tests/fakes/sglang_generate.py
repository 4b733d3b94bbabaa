"""A stand-in for SGLang's native `/generate` (SGLang cannot run here: its PyPI build needs CUDA,
../shared/reference/runtime-facts.md), in front of a real model: the embedded engine's `/v1/completions`.

What it keeps of SGLang (python/sglang/srt/managers/io_struct.py `GenerateReqInput`,
sampling/sampling_params.py, tokenizer_manager_components/output_processor.py, mid-2026):
- the request: `input_ids`, `sampling_params` (an unknown key is a 400, as SGLang's `SamplingParams(**)`
  raises), `stream`, `return_logprob`, `logprob_start_len`;
- the answer: `text`, `output_ids`, `meta_info` with `id`, `finish_reason` (`{"type": "stop", "matched":
  id}` / `{"type": "length", "length": n}`, null until the end), `prompt_tokens`, `completion_tokens`,
  `cached_tokens`, `weight_version` (a string; "default" until weights are updated) and
  `output_token_logprobs` as `[logprob, token_id, null]` when `return_logprob`;
- streaming: every `data:` event holds the answer so far (SGLang's default), or only what is new with
  `incremental=True` (`--incremental-streaming-output`); `data: [DONE]` ends it;
- `/v1/models` lists the model with `root` and `max_model_len`, as SGLang's `ModelCard`.
What it does not: batches (lists of prompts), `text` prompts, `n > 1`, structured output (`json_schema`,
`regex`: accepted and not enforced), input logprobs, `weight_version` updates (`policy_version` of the
engine, when it has one, is given as the version string). Knobs for the tests: `flip_last_id` sends an
`output_ids` that disagrees with the logprob entries, `abort` ends each generation with finish type abort.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# SGLang sampling_params key -> the engine's /v1/completions field.
_PARAMS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "sampling_seed": "seed",
}
_NOT_ENFORCED = {"json_schema", "regex", "ebnf", "logit_bias", "no_stop_trim"}


@dataclass
class SGLangStandIn:
    engine_url: str
    incremental: bool = False
    flip_last_id: bool = False
    abort: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(
            routes=[Route("/generate", self.generate, methods=["POST"]), Route("/v1/models", self.models)]
        )

    async def models(self, request: Request) -> Response:
        async with httpx.AsyncClient(base_url=self.engine_url) as http:
            cards = (await http.get("/v1/models")).json()["data"]
        keep = ("id", "object", "created", "owned_by", "root", "max_model_len")
        return JSONResponse({"object": "list", "data": [{k: c.get(k) for k in keep} for c in cards]})

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        params = body.get("sampling_params") or {}
        unknown = sorted(set(params) - set(_PARAMS) - _NOT_ENFORCED)
        if unknown or not isinstance(body.get("input_ids"), list):
            message = f"unexpected keyword argument {unknown[0]!r}" if unknown else "input_ids is required"
            return JSONResponse({"error": {"message": message}}, status_code=400)
        wire: dict[str, Any] = {_PARAMS[k]: v for k, v in params.items() if k in _PARAMS}
        wire.setdefault("max_tokens", 128)  # SGLang's default max_new_tokens
        wire.update(prompt=body["input_ids"], return_token_ids=True, logprobs=0, model=None)
        logprobs = bool(body.get("return_logprob"))
        async with httpx.AsyncClient(base_url=self.engine_url, timeout=120) as http:
            wire["model"] = (await http.get("/v1/models")).json()["data"][0]["id"]
        if body.get("stream"):
            return StreamingResponse(self._events(wire, logprobs), media_type="text/event-stream")
        async with httpx.AsyncClient(base_url=self.engine_url, timeout=120) as http:
            answer = (await http.post("/v1/completions", json=wire)).json()
        choice = answer["choices"][0]
        state = _State(len(body["input_ids"]), answer.get("policy_version"))
        state.add(choice.get("text") or "", choice["token_ids"], choice["logprobs"]["token_logprobs"])
        return JSONResponse(self._out(state, choice["finish_reason"], logprobs, whole=True))

    async def _events(self, wire: dict[str, Any], logprobs: bool) -> AsyncIterator[bytes]:
        state = _State(len(wire["prompt"]), None)
        async with (
            httpx.AsyncClient(base_url=self.engine_url, timeout=120) as http,
            http.stream("POST", "/v1/completions", json={**wire, "stream": True}) as resp,
        ):
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                if state.version is None:
                    state.version = chunk.get("policy_version")
                lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
                state.add(choice.get("text") or "", choice.get("token_ids") or [], lps)
                out = self._out(state, choice.get("finish_reason"), logprobs, whole=not self.incremental)
                state.mark()
                yield b"data: " + json.dumps(out).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _out(self, state: _State, finish: str | None, logprobs: bool, *, whole: bool) -> dict[str, Any]:
        start = 0 if whole else state.sent
        ids = list(state.ids[start:])
        entries = [[lp, t, None] for lp, t in zip(state.logprobs[start:], ids, strict=True)]
        if self.flip_last_id and finish is not None and ids:
            ids[-1] += 1
        reason: dict[str, Any] | None = None
        if finish is not None:
            reason = {"type": "abort", "message": "aborted by the test"} if self.abort else (
                {"type": "length", "length": len(state.ids)} if finish == "length"
                else {"type": "stop", "matched": state.ids[-1] if state.ids else None}
            )  # fmt: skip
        meta: dict[str, Any] = {
            "id": "0123abcd",
            "finish_reason": reason,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": len(state.ids),
            "cached_tokens": 0,
            "weight_version": "default" if state.version is None else str(state.version),
        }
        if logprobs:
            meta["output_token_logprobs"] = entries
        return {
            "text": state.text[state.sent_text if not whole else 0 :],
            "output_ids": ids,
            "meta_info": meta,
        }


@dataclass
class _State:
    prompt_tokens: int
    version: int | None
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent: int = 0
    sent_text: int = 0

    def add(self, text: str, ids: list[int], logprobs: list[float]) -> None:
        self.text += text
        self.ids += ids
        self.logprobs += logprobs

    def mark(self) -> None:
        self.sent, self.sent_text = len(self.ids), len(self.text)
