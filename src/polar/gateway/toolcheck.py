"""Tool calls that did not come out as calls: caught on the record, so they never pass as answers.

An inference server's tool parser that fails on what the model wrote does not fail the request: vLLM's
parsers (hermes and the others) return the raw markup as the assistant's plain content with no
`tool_calls` (measured: a cut-off `<tool_call>` under `tool_choice: required` comes back as content, and the
hermes parser only logs its JSONDecodeError). A harness reads that as a final answer, and if the task's
check happens to pass, the broken call would be trained as a good one. Two more shapes of the same failure
reach the harness as calls that cannot run: a call naming a tool the request did not offer, and arguments
that are not a JSON object the tool's parameter schema accepts.

`problems` names what is wrong with one answer; the proxy puts those flags on the call's record, each with
`tool_call_parse_error` beside it, which `polar.rollout.rewards` turns into reward 0 for the trace (still
trainable: the policy learns against the broken call). The check reads only what the request offered and
the answer sampled; it never changes the answer.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from jsonschema.protocols import Validator
from jsonschema.validators import Draft202012Validator, validator_for

from polar.gateway.canonical import CanonicalRequest, Completion, ToolCall
from polar.jsontypes import JSON
from polar.store.records import FLAG_TOOL_PARSE_ERROR

FLAG_MARKUP = "tool_call_unparsed_markup"  # call markup that did not parse: left in the content, or repaired
FLAG_UNKNOWN_TOOL = "tool_call_unknown_tool"  # a call to a tool the request did not offer
FLAG_BAD_ARGUMENTS = "tool_call_bad_arguments"  # not JSON, not an object, or not what the schema accepts
FLAGS = (FLAG_MARKUP, FLAG_UNKNOWN_TOOL, FLAG_BAD_ARGUMENTS)

# The start tags of the tool-call formats inference servers parse (vLLM's parsers and the engine's): a
# parser that recognises one of these in the sampled text and fails leaves it in the content.
START_TAGS = (
    "<tool_call>",  # hermes, qwen2.5/qwen3, qwen3_coder, glm4.5
    "<function=",  # qwen3_coder, llama4 pythonic-XML
    "[TOOL_CALLS]",  # mistral
    "<|python_tag|>",  # llama3_json
    "<tool_calls>",  # jamba, minimax, hunyuan
    "<|tool_call|>",  # granite
    "<|tool_calls_section_begin|>",  # kimi_k2
    "<\uff5ctool\u2581calls\u2581begin\uff5c>",  # deepseek_v3 (full-width bars, "▁" for spaces)
    "<|action_start|><|plugin|>",  # internlm2
    "<seed:tool_call>",  # seed_oss
)

_CACHE_ENTRIES = 4096
_validators: dict[bytes, Validator | None] = {}  # serialized parameter schema -> its validator
_lock = threading.Lock()


def flags(req: CanonicalRequest, comp: Completion) -> tuple[str, ...]:
    """The record flags for `comp` as an answer to `req`: `problems`, with `tool_call_parse_error` (the flag
    rewards read) when there is one."""
    offered = [*(req.tools or ()), *req.loaded_tools]
    found = problems(offered, comp.content, comp.tool_calls, comp.sampled_text)
    return (*found, FLAG_TOOL_PARSE_ERROR) if found else ()


def problems(
    offered: Sequence[dict[str, Any]] | None,
    content: str | None,
    calls: Iterable[ToolCall],
    sampled: str | None = None,
) -> list[str]:
    """What keeps this answer from being the calls the model meant, as record flags (empty: nothing).

    `offered` are the Chat function tools the policy could call (the request's `tools` and any a client
    tool search loaded); a request that offered none has no call to fail. `sampled` is the text of the
    sampled tokens where the server reports it (vLLM): markup a parser swallowed or repaired shows there."""
    calls = list(calls)
    if not offered:
        return []
    found: list[str] = []
    if (content and any(tag in content for tag in START_TAGS)) or (
        sampled is not None and _unparsed(sampled, len(calls))
    ):
        found.append(FLAG_MARKUP)
    if not calls:  # most answers: the offered tools' schemas are not looked at
        return found
    schemas = {}
    for tool in offered:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            schemas[fn["name"]] = fn.get("parameters")
    for call in calls:
        if call.name not in schemas:
            found.append(FLAG_UNKNOWN_TOOL)
        elif not _arguments_fit(call.arguments, schemas[call.name]):
            found.append(FLAG_BAD_ARGUMENTS)
    return list(dict.fromkeys(found))


def _unparsed(sampled: str, n_calls: int) -> bool:
    """Whether the sampled answer holds call markup that is not the `n_calls` calls the server returned.

    vLLM's streaming hermes parser completes a cut-off call (`{"color": "green"}` from a body missing its
    closing brace, measured on vLLM 0.32) where the whole-answer parser gives the text back as content: the
    harness then runs a call the model never wrote whole. So for `<tool_call>` JSON bodies each one must be
    a JSON object with a name, one per returned call; for other formats, markup with no call at all."""
    answer = sampled.rsplit("</think>", 1)[-1]  # a tag in the reasoning is not a call
    if not any(tag in answer for tag in START_TAGS):
        return False
    if n_calls == 0:
        return True
    if "<tool_call>" not in answer or "<function=" in answer:
        return False  # a format whose bodies are not JSON (qwen3_coder's XML): its parser's count decides
    bodies = _HERMES_BODY.findall(answer)
    return len(bodies) != n_calls or not all(_named_object(b) for b in bodies)


_HERMES_BODY = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _named_object(body: str) -> bool:
    try:
        value = orjson.loads(body.strip())
    except orjson.JSONDecodeError:
        return False
    return isinstance(value, dict) and isinstance(value.get("name"), str)


def _arguments_fit(arguments: str, schema: JSON) -> bool:
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(value, dict):
        return False  # a function's arguments are an object, whatever its schema says
    validator = _validator(schema)
    try:
        return validator is None or validator.is_valid(value)
    except RecursionError:
        return False


def _validator(schema: JSON) -> Validator | None:
    """The schema's validator, compiled once per distinct schema (harnesses resend the same tools every
    call); None for no schema or one that cannot be compiled (the gateway refused invalid ones already)."""
    if not isinstance(schema, dict | bool):
        return None
    key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    if key in _validators:
        return _validators[key]
    try:
        cls = validator_for(schema, default=Draft202012Validator)
        validator: Validator | None = cls(schema)
    except Exception:  # an unusable schema judges nothing
        validator = None
    with _lock:
        if len(_validators) >= _CACHE_ENTRIES:
            del _validators[next(iter(_validators))]
        _validators[key] = validator
    return validator
