"""Import arrows point down: each part of `polar` imports only parts of its own layer or below, and no two
parts import each other. Every import counts, the ones inside functions (imported on use) and under
TYPE_CHECKING too: each is a dependency a reader must know about. A new top-level module or subpackage
is placed in `LAYERS` by whoever adds it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import polar

# Lowest first. Store, runtime and engine import nothing above them; the gateway and the evaluators sit on
# those; the rollout service (server and node) on them; then what composes the service (client, dashboard,
# stack), the trainer, and the commands.
LAYERS: list[set[str]] = [
    {"hints", "yamlpos", "edge", "http_server", "serving", "auth", "limits", "netguard", "retry", "metrics",
     "plugins", "extras", "modelsource", "logs", "interrupt", "chat", "jsontypes", "memory"},
    {"store", "runtime", "engine", "task"},
    {"harness", "trajectory"},
    {"gateway", "evaluate"},
    {"rollout"},
    {"client", "dashboard", "replay"},
    {"stack"},
    {"train"},
    {"cli", "docs", "__main__", "__init__"},
]  # fmt: skip
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}
SRC = Path(polar.__file__).parent


def _imports() -> dict[tuple[str, str], list[str]]:
    """(part, imported part) -> the modules of `part` that import it."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        part = rel.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = name.split(".")
                if target[0] == "polar" and len(target) > 1 and target[1] != part:
                    edges[(part, target[1])].append(f"{rel}:{node.lineno}")
    return edges


def test_every_part_has_a_layer() -> None:
    parts = {
        p.name.removesuffix(".py")
        for p in SRC.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    assert parts - LAYER.keys() == set(), "place these in tests/test_layers.py LAYERS"


def test_imports_point_down() -> None:
    upward = [
        f"{where}: polar.{part} (layer {LAYER[part]}) imports polar.{target} (layer {LAYER[target]})"
        for (part, target), wheres in _imports().items()
        if LAYER.get(target, -1) > LAYER.get(part, len(LAYERS))
        for where in wheres
    ]
    assert upward == []


def test_no_two_parts_import_each_other() -> None:
    edges = _imports()
    loops = sorted({tuple(sorted(pair)) for pair in edges if (pair[1], pair[0]) in edges})
    assert loops == [], [(pair, edges[pair][:2], edges[pair[::-1]][:2]) for pair in loops]
