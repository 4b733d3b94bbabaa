"""Where a value sits in a YAML (or JSON) file, so an error can point at its line.

One parse keeps both the plain value and the node tree that knows each value's line:

    doc = parse(text, "tasks.yaml")       # YAMLSyntaxError("tasks.yaml:3: ...") when it is not YAML/JSON
    doc.data                              # what yaml.safe_load returns
    doc.where(("tasks", 1, "runtime"))    # "tasks.yaml:14": the line of that value, or of the deepest part
                                          # of the path that exists ("tasks.yaml" if none does)
    doc.at(("tasks", 1, "runtime"))       # "tasks.yaml:14: tasks[1].runtime"
    field_path(("tasks", 1, "runtime"))   # "tasks[1].runtime"
    parse_field_path("tasks[1].runtime")  # ("tasks", 1, "runtime")

Used by every loader whose errors name a file's line: task files (`polar.rollout.taskfile`), the training
config (`polar.train.config`) and `polar submit`, which maps a server's refusal back to the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from polar.hints import yaml_problem

Loc = tuple[Any, ...]


class YAMLSyntaxError(ValueError):
    """Text that is not YAML (JSON is YAML); `where` is `source:line` when the parser knows the line."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Document:
    source: str
    data: Any
    root: yaml.Node | None

    def line(self, loc: Loc) -> int | None:
        """The 1-based line of the value at `loc` (or of its deepest existing ancestor); None if empty."""
        node = self.root
        line = None if node is None else node.start_mark.line + 1
        for step in loc:
            if isinstance(node, yaml.MappingNode):
                nxt = next((v for k, v in node.value if getattr(k, "value", None) == step), None)
            elif (
                isinstance(node, yaml.SequenceNode) and isinstance(step, int) and 0 <= step < len(node.value)
            ):
                nxt = node.value[step]
            else:
                nxt = None
            if nxt is None:
                break
            node = nxt
            line = node.start_mark.line + 1
        return line

    def where(self, loc: Loc = ()) -> str:
        """`source:line` of the value at `loc`, or `source` when no line is known."""
        line = self.line(loc)
        return f"{self.source}:{line}" if line else self.source

    def at(self, loc: Loc, whole: str = "") -> str:
        """`source:line: field.path` of `loc` (`whole` names the empty path)."""
        return f"{self.where(loc)}: {field_path(loc) or whole}"


def parse(text: str, source: str) -> Document:
    """Parse `text` once (safe constructors only), keeping the node tree for line numbers."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as exc:
        # The line of the mistake, not where the parser gave up (an unclosed quote): polar.hints.
        line, problem = yaml_problem(exc)
        raise YAMLSyntaxError(f"{source}:{line}" if line else source, problem) from None
    finally:
        loader.dispose()
    return Document(source, data, root)


def field_path(loc: Loc) -> str:
    """`("tasks", 1, "agent")` -> `tasks[1].agent`."""
    out = ""
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


def parse_field_path(path: str) -> Loc:
    """`tasks[1].agent.harness` -> `("tasks", 1, "agent", "harness")`: the inverse of `field_path`."""
    return tuple(int(i) if i else k for k, i in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path))
