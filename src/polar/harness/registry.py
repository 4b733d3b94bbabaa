"""Harness presets by name, `polar.harnesses` entry points, or a class by import path "pkg.mod:Class"
where `polar.plugins` allows one (a local task file, or a module the operator allowed).

`get_harness` builds the preset with the task's `agent.settings`, so an unknown name, an import that fails
or a bad setting raises `ValueError` when the task is submitted, not in the middle of a run.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from typing import Any

from polar import plugins
from polar.harness import presets
from polar.harness.base import Harness
from polar.store.records import CompletionRecord

_PRESETS = {
    "builtin": "polar.harness.builtin:BuiltinHarness",
    "shell": "polar.harness.shell:ShellHarness",
}
_METHODS = ("setup", "command", "env", "post_run", "classify")


def _cli_presets() -> dict[str, str]:
    """The CLI presets: every module of `polar.harness.presets`, by module name."""
    return {m.name: f"{presets.__name__}.{m.name}:PRESET" for m in pkgutil.iter_modules(presets.__path__)}


_CLI_PRESETS = _cli_presets()
# A new CLI preset is one module in polar.harness.presets, found by its name.
HARNESSES = plugins.Registry("harness", {**_CLI_PRESETS, **_PRESETS})


def runs_from_tool_cache(name: str) -> bool:
    """Whether harness `name` is a CLI preset, whose pinned program runs from the node's tool cache
    (`polar.harness.install`): a container runtime must then mount that cache read-only."""
    return name in _CLI_PRESETS


def harness_names() -> list[str]:
    """The built-in presets and installed entry points (what a task over HTTP may name)."""
    return HARNESSES.names()


def _load(name: str) -> Any:
    obj = HARNESSES.load(name)
    if not callable(obj):
        raise ValueError(f"harness {name!r} is not a class")
    return obj


def get_harness(name_or_import_path: str, settings: dict[str, Any] | None = None) -> Harness:
    """The harness `name_or_import_path` built with `settings` (its constructor validates them)."""
    cls = _load(name_or_import_path)
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


def classifier(name: str, settings: dict[str, Any]) -> Callable[[CompletionRecord], tuple[str, ...]]:
    """The side-call classifier of harness `name` (`polar.gateway.routing.Classifiers`), which nodes and
    `polar gateway` hand the gateway so that it needs no knowledge of harnesses."""
    return get_harness(name, settings).classify
