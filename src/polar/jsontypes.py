"""Names for decoded JSON whose shape the wire defines, not polar: request and response bodies, task
settings, metadata. `Any` all the same, but a reader sees the value is open on purpose, not untyped.

    def relay(body: JSONObject) -> JSON: ...
"""

from __future__ import annotations

from typing import Any, TypeAlias

JSON: TypeAlias = Any
"""A decoded JSON value (object, array, string, number, bool or null) whose shape the wire defines."""

JSONObject: TypeAlias = dict[str, Any]
"""A decoded JSON object whose keys and values the wire defines."""
