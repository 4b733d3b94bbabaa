"""Tool parameter schemas are checked against the JSON Schema metaschema at the edge.

An invalid schema (`"type": "strng"`, `"required": "path"`, a `pattern` that is no regex) used to reach the
inference server, which failed on it (vLLM builds its tool-call grammar from it) and the harness saw a 502:
the caller's mistake, blamed on the backend. Now it is a 400 naming the tool.

Harnesses resend the same ~25 tools on every call, and the `jsonschema` metaschema check costs milliseconds
per schema, so verdicts are cached by the schema's serialized bytes: a warm call pays one `orjson.dumps` and
one dict lookup per tool.
"""

from __future__ import annotations

import threading

import orjson
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from jsonschema.validators import Draft202012Validator, validator_for

from polar.gateway.errors import invalid
from polar.jsontypes import JSON

_CACHE_ENTRIES = 4096
_CACHEABLE_BYTES = 256 << 10  # bigger schemas are judged every time rather than pinned in memory
_MESSAGE_CHARS = 300

_UNSEEN = object()
_verdicts: dict[bytes, object] = {}  # serialized schema -> None (valid) or why it is not
_lock = threading.Lock()  # several gateways may share a process (tests, `polar run`): one writer at a time
_meta_validators: dict[type[Validator], Validator] = {}


def check_tool_schema(schema: JSON, tool: str, name: JSON, field: str) -> None:
    """Raise a 400 naming the tool (where it sits, `tools[3]`, and its name) and the schema's field within
    it (`input_schema`) when `schema` is not a valid JSON Schema."""
    key = orjson.dumps(schema)
    verdict = _verdicts.get(key, _UNSEEN)  # a lookup needs no lock: dict reads are atomic
    if verdict is _UNSEEN:
        verdict = _judge(schema)
        if len(key) <= _CACHEABLE_BYTES:
            with _lock:
                if len(_verdicts) >= _CACHE_ENTRIES:
                    del _verdicts[next(iter(_verdicts))]  # the oldest verdict
                _verdicts[key] = verdict
    if verdict is not None:
        message = f"{tool}.{field} (tool {name!r}) is not a valid JSON Schema: {verdict}"
        raise invalid(message, f"{tool}.{field}")


def _judge(schema: JSON) -> str | None:
    """None for a valid schema, else the most relevant metaschema violation, where it is, in words."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a schema is an object or a boolean, not {type(schema).__name__}"
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        return "'$schema' must be a string (the URI of a JSON Schema draft)"
    # `$schema` picks the draft (Claude Code declares draft-07); without one, the current draft 2020-12.
    cls = validator_for(schema, default=Draft202012Validator)
    meta = _meta_validators.get(cls)
    if meta is None:
        meta = _meta_validators[cls] = cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)
    try:
        error = best_match(meta.iter_errors(schema))
    except RecursionError:
        return "it nests too deeply to be checked"
    if error is None:
        return None
    message = error.message
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + "…"
    return f"{message} (at {error.json_path})"
