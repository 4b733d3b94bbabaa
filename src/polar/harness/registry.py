"""Harness presets by name, or any class by import path "pkg.mod:Class".

`get_harness` builds the preset with the task's `agent.settings`, so an unknown name, an import that fails
or a bad setting raises `ValueError` when the task is submitted, not in the middle of a run.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from polar.harness import presets
from polar.harness.base import Harness

_PRESETS = {
    "builtin": "polar.harness.builtin:BuiltinHarness",
    "shell": "polar.harness.shell:ShellHarness",
}
_METHODS = ("setup", "command", "env", "post_run", "classify")


def _cli_presets() -> dict[str, str]:
    """The CLI presets: every module of `polar.harness.presets`, by module name."""
    return {m.name: f"{presets.__name__}.{m.name}:PRESET" for m in pkgutil.iter_modules(presets.__path__)}


def harness_names() -> list[str]:
    return sorted({**_PRESETS, **_cli_presets()})


def _load(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown harness {path!r}: expected one of {harness_names()} or 'pkg.mod:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load harness {path!r}: {e}") from e
    if not callable(obj):
        raise ValueError(f"harness {path!r} is not a class")
    return obj


def get_harness(name_or_import_path: str, settings: dict[str, Any] | None = None) -> Harness:
    """The harness `name_or_import_path` built with `settings` (its constructor validates them)."""
    known = {**_cli_presets(), **_PRESETS}
    cls = _load(known.get(name_or_import_path, name_or_import_path))
    try:
        harness = cls(dict(settings or {}))
    except ValueError:
        raise
    except Exception as e:  # a third-party class: whatever it raises becomes the one clear error type
        raise ValueError(f"harness {name_or_import_path!r} refused its settings: {e}") from e
    missing = [m for m in _METHODS if not callable(getattr(harness, m, None))]
    if missing or not isinstance(getattr(harness, "name", None), str):
        what = f"methods {missing}" if missing else "a `name`"
        raise ValueError(
            f"harness {name_or_import_path!r} does not implement the Harness contract: lacks {what}"
        )
    result: Harness = harness
    return result
