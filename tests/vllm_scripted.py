"""A scripted policy behind a real vLLM: the relay a node's gateway calls instead of the server itself.

For each chat call the relay asks the script (the same `body -> Reply` functions the fake vLLM runs) what
the policy says, writes that turn as the model's chat template writes an assistant turn (Qwen3's:
content, then one `<tool_call>` block per call with the arguments as `tojson` renders them, then
`<|im_end|>`), tokenizes it with the served model's tokenizer, and forwards the call unchanged but for
`vllm_xargs.polar_forced`, which `tests/vllm_plugins/forced_tokens.py` (loaded into that vLLM) makes it
sample. Everything else is the real server's: the rendering and tokenizing of the CLI's conversation, the
hermes tool parser, token ids, logprobs, the prefix cache, streaming, the errors of its own checks. Any
other route (models, tokenize, metrics, the RL routes) passes through untouched.

A script that raises `tests.fakes.fake_vllm.HTTPError` answers that status in vLLM's error shape, without
calling vLLM (the benchmark's `fault` scenario).

A call the gateway sends again with only its output budget changed (vLLM refused a `max_tokens` above the
context; the gateway resends it cut to what fits) gets the turn the script gave the first time, as a model
would write the same turn for the same prompt: scripts count their calls, and a second call would advance
them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.fakes.fake_vllm import HTTPError, Reply
from tests.fakes.server import lifespan, read_body, serve
from tests.fakes.wire import error_body

PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugins"
# `start_vllm(..., extra=FORCING_FLAGS, env_extra=FORCING_ENV)` loads the processor the relay relies on.
FORCING_FLAGS = ("--logits-processors", "forced_tokens:ForcedTokens")
FORCING_ENV = {"PYTHONPATH": str(PLUGIN_DIR)}
_BUDGET = ("max_tokens", "max_completion_tokens")
_HOP = {b"transfer-encoding", b"connection"}  # hop-by-hop; the raw bytes pass on with their length


def turn_text(reply: Reply) -> str:
    """The assistant turn as Qwen3's chat template renders it in a later prompt (without `<|im_end|>`):
    what a model trained on that template writes."""
    if reply.reasoning is not None or reply.finish_reason is not None:
        raise ValueError("the relay scripts content and tool calls only")
    out = reply.content or ""
    for i, (name, arguments) in enumerate(reply.tool_calls):
        if i or out:
            out += "\n"
        rendered = json.dumps(json.loads(arguments), ensure_ascii=False)  # jinja's tojson
        out += '<tool_call>\n{"name": "' + name + '", "arguments": ' + rendered + "}\n</tool_call>"
    return out


_TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>", re.DOTALL)


def chat_of_prompt(text: str) -> dict[str, Any]:
    """The chat call (`messages`, `tools`) a Qwen3-rendered prompt text was rendered from, as far as the
    scripts read it: roles and contents, tool results, the assistant turns' tool calls, the tool list."""
    messages: list[dict[str, Any]] = []
    tools: list[Any] = []
    for role, content in _TURN.findall(text):
        if role == "system" and "<tools>\n" in content:
            listed = content.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
            tools = [json.loads(line) for line in listed.splitlines() if line.strip()]
            content = content.split("# Tools", 1)[0].rstrip("\n")
            if not content:
                continue
        if role == "user" and content.startswith("<tool_response>"):
            for result in re.findall(r"<tool_response>\n(.*?)\n</tool_response>", content, re.DOTALL):
                messages.append({"role": "tool", "content": result})
            continue
        if role == "assistant":
            content = re.sub(r"<think>.*?</think>\s*", "", content, flags=re.DOTALL)
            calls = [
                json.loads(c) for c in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", content, re.DOTALL)
            ]
            message: dict[str, Any] = {"role": role, "content": content.split("<tool_call>", 1)[0].strip()}
            if calls:
                message["tool_calls"] = [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                    }
                    for i, c in enumerate(calls)
                ]
            messages.append(message)
            continue
        messages.append({"role": role, "content": content})
    return {"messages": messages, "tools": tools}


class ScriptedRelay:
    """The ASGI app of the relay (`relayed` serves it)."""

    def __init__(self, upstream: str, tokenizer_dir: Path, script: Callable[[dict[str, Any]], Reply]):
        from transformers import AutoTokenizer

        self.upstream = upstream.rstrip("/")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.script = script
        self.forced_calls = 0
        self._replies: dict[bytes, Reply] = {}  # by the call without its output budget

    def forced_ids(self, reply: Reply) -> list[int]:
        ids: list[int] = self.tokenizer.encode(turn_text(reply), add_special_tokens=False)
        return [*ids, self.end]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        path, method = scope["path"], scope["method"]
        body = orjson.loads(raw) if method == "POST" and path.endswith("/completions") else None
        if body is not None and (path.endswith("/chat/completions") or isinstance(body.get("prompt"), list)):
            key = orjson.dumps(
                {k: v for k, v in body.items() if k not in _BUDGET}, option=orjson.OPT_SORT_KEYS
            )
            # A token-id prompt (the gateway rendered it: `render: gateway`) is read back into the chat
            # call the script answers.
            chat = body if "messages" in body else chat_of_prompt(self.tokenizer.decode(body["prompt"]))
            try:
                reply = self._replies.get(key) or self.script(chat)
            except HTTPError as e:
                payload = orjson.dumps(error_body("vllm", e.status, e.message, e.err_type))
                headers = [(b"content-type", b"application/json")]
                await send({"type": "http.response.start", "status": e.status, "headers": headers})
                await send({"type": "http.response.body", "body": payload})
                return
            self._replies[key] = reply
            body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), "polar_forced": self.forced_ids(reply)}
            raw = orjson.dumps(body)
            self.forced_calls += 1
        url = self.upstream + path + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        headers = [
            (k, v) for k, v in scope["headers"] if k.lower() not in (*_HOP, b"host", b"content-length")
        ]
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as http:
            request = http.build_request(method, url, headers=headers, content=raw)
            response = await http.send(request, stream=True)
            try:
                out = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP]
                await send({"type": "http.response.start", "status": response.status_code, "headers": out})
                async for piece in response.aiter_raw():
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            finally:
                await response.aclose()


@contextmanager
def relayed(upstream: str, tokenizer_dir: Path, script: Callable[[dict[str, Any]], Reply]) -> Iterator[str]:
    """The relay on a loopback port in front of `upstream` (a vLLM with `FORCING_FLAGS`); yields its URL."""
    with serve(ScriptedRelay(upstream, tokenizer_dir, script)) as server:
        yield server.url
