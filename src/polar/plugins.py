"""Which code a task may name: no code path runs code named by a network request.

A task names its harness, evaluator and trajectory builder. Over HTTP (`polar serve`, a node's control
listener) those names must be *registered*: a built-in, a Python entry point installed on the machine
(groups `polar.harnesses`, `polar.evaluators`, `polar.builders`), or an import path `package.module:Name`
whose module the operator allowed (`polar serve --plugin package.module`, `polar node --plugin ...`).
`os:system` and `subprocess:Popen` are refused with a message saying how to register code.

Task files loaded by the local CLI (`polar run`, `generate`, `train`) are the user's own: their import
paths are resolved relative to the file that names them (then on `sys.path`), imported once, and trusted
in this process by their exact string, so the in-process server and node accept them.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, Generic, Literal, cast

from typing_extensions import TypeVar

Kind = Literal["harness", "evaluator", "builder"]
GROUPS: dict[Kind, str] = {
    "harness": "polar.harnesses",
    "evaluator": "polar.evaluators",
    "builder": "polar.builders",
}

T = TypeVar("T", default=Any)  # what a registry's names denote; Any for the open kinds (user code)

_trusted: dict[str, Any] = {}  # exact import path -> the object, vouched for by a local task file
_allowed_modules: set[str] = set()  # modules (and their submodules) the operator allowed


class PluginError(ValueError):
    """A name that is not registered, or an import path that may not or cannot be loaded."""


def is_import_path(name: str) -> bool:
    return ":" in name


def allow_modules(modules: list[str] | tuple[str, ...]) -> None:
    """Operator configuration: tasks over HTTP may name `module:Name` for these modules (and submodules).
    Each module is imported now, so a typo fails at server start, not at the first task."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise PluginError(f"--plugin {module}: cannot import it: {type(exc).__name__}: {exc}") from None
        _allowed_modules.add(module)


def _allowed(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in _allowed_modules)


def _split(path: str) -> tuple[str, str]:
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise PluginError(f"{path!r} is not an import path 'package.module:Name'")
    return module, attr


def _get(module: Any, attr: str, path: str) -> Any:
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"cannot load {path!r}: {module.__name__} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def entry_point_names(kind: Kind) -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUPS[kind]))


def _entry_point(kind: Kind, name: str) -> EntryPoint | None:
    found = [ep for ep in entry_points(group=GROUPS[kind]) if ep.name == name]
    return found[0] if found else None


def load_registered(kind: Kind, name: str, known: list[str]) -> Any:
    """The object a task's `name` denotes, if it is registered: an entry point, a trusted import path, or
    an import path in an operator-allowed module. Built-ins are the caller's (its `known` names list)."""
    ep = _entry_point(kind, name)
    if ep is not None:
        try:
            return ep.load()
        except Exception as exc:
            raise PluginError(
                f"{kind} {name!r} (entry point {ep.value}): {type(exc).__name__}: {exc}"
            ) from None
    if name in _trusted:
        return _trusted[name]
    if not is_import_path(name):
        names = known + entry_point_names(kind)
        close = difflib.get_close_matches(name.replace("-", "_"), names, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PluginError(f"unknown {kind} {name!r}{hint}; registered: {', '.join(names)}")
    module, attr = _split(name)
    if not _allowed(module):
        raise PluginError(
            f"{kind} {name!r}: import paths are not accepted from the network. Name a registered {kind} "
            f"({', '.join(known + entry_point_names(kind))}), install it as a `{GROUPS[kind]}` entry point, "
            f"or have the operator allow its module (`--plugin {module}`); task files run with the local "
            "CLI (`polar run`) may use import paths"
        )
    return _import(module, attr, name)


@dataclass
class Registry(Generic[T]):
    """Code of one kind by name, the same shape for every kind polar looks up by name: built-ins as
    "module:attr" strings, imported on first use, and code the calling program registers in this process.

    Open kinds (harnesses, evaluators, trajectory builders) are what a task names: beyond the known names,
    `load` takes the installed entry points and allowed import paths that `load_registered` polices.
    Closed kinds (runtimes, gateway dialects) are polar's own tables: a name is a built-in or an error,
    and `entries` loads the whole table for the code that drives from it (the runtime factory, the
    gateway's routes)."""

    kind: str
    builtin: Mapping[str, str]  # name -> "module:attr"
    closed: bool = False
    registered: dict[str, T] = field(default_factory=dict)

    def known(self) -> list[str]:
        """The built-in and registered names."""
        return sorted({*self.builtin, *self.registered})

    def names(self) -> list[str]:
        """Every name a task over HTTP may use: the known ones and the installed entry points."""
        if self.closed:
            return self.known()
        return sorted({*self.known(), *entry_point_names(self._open_kind())})

    def load(self, name: str) -> T:
        """What `name` denotes; PluginError saying why when nothing may be loaded for it."""
        if name in self.registered:
            return self.registered[name]
        if name in self.builtin:
            return cast(T, import_path(self.builtin[name]))
        if self.closed:
            raise PluginError(f"unknown {self.kind} {name!r}; known: {', '.join(self.builtin)}")
        return cast(T, load_registered(self._open_kind(), name, self.known()))

    def entries(self) -> dict[str, T]:
        """Every built-in (in the table's order) and registered entry, loaded."""
        return {name: self.load(name) for name in [*self.builtin, *self.registered]}

    def register(self, name: str, obj: T, *, replace: bool = False) -> None:
        """Make `obj` available as `name` in this process (code the program names itself: not policed)."""
        if self.closed:
            raise PluginError(
                f"the {self.kind} table is polar's own; a new {self.kind} is a module of polar's"
            )
        if not name or ":" in name:
            raise PluginError(f"a {self.kind} name must be non-empty and contain no ':', got {name!r}")
        if not replace and name in self.known():
            raise PluginError(f"a {self.kind} named {name!r} exists; pass replace=True to override it")
        self.registered[name] = obj

    def _open_kind(self) -> Kind:
        if self.kind not in GROUPS:
            raise PluginError(f"{self.kind} names no entry-point group: it must be closed")
        return self.kind


def import_path(path: str) -> Any:
    """The object at "module:attr" (code polar or the calling program names: not policed)."""
    module, attr = _split(path)
    return _import(module, attr, path)


def _import(module_name: str, attr: str, path: str) -> Any:
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or whatever the module raises while importing
        raise PluginError(f"cannot import {module_name} for {path!r}: {type(exc).__name__}: {exc}") from None
    return _get(module, attr, path)


def _module_file(base: Path, module: str) -> Path | None:
    """`base/a/b.py` or `base/a/b/__init__.py` for module `a.b`, if there is one."""
    rel = Path(*module.split("."))
    for candidate in (base / rel.with_suffix(".py"), base / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def trust_file_import(path: str, base: Path) -> Any:
    """Import `path` as named by a local task file in directory `base` (relative to it first, then on
    `sys.path`) and trust it in this process. Raises PluginError saying why it cannot be loaded."""
    if path in _trusted:
        return _trusted[path]
    module, attr = _split(path)
    local = _module_file(base, module)
    if local is not None:
        root = str(base.resolve())
        if root not in sys.path:
            sys.path.insert(0, root)  # kept: the module may import its siblings later
        loaded = sys.modules.get(module)
        if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() != local.resolve():
            raise PluginError(
                f"{path!r}: a different module named {module!r} is already loaded "
                f"({getattr(loaded, '__file__', None)}); rename {local.name}"
            )
    obj = _import(module, attr, path)
    if not callable(obj):
        raise PluginError(f"{path!r} is not a class or function")
    _trusted[path] = obj
    return obj
