"""`polar.yamlpos`: one parse of a YAML/JSON file that knows each value's line, used by task files, the
training config and `polar submit`."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from polar import yamlpos

TEXT = """\
tasks:
  - task_id: a
    instruction: x
  - task_id: b
    runtime:
      backend: vm
      prepare:
        - {type: exec, cmd: make}
"""


def test_lines_of_values_and_their_deepest_existing_ancestor() -> None:
    doc = yamlpos.parse(TEXT, "t.yaml")
    assert doc.data == yaml.safe_load(TEXT)
    assert doc.line(()) == 1
    assert doc.line(("tasks", 1, "runtime", "backend")) == 6
    assert doc.line(("tasks", 1, "runtime", "prepare", 0, "cmd")) == 8
    assert doc.line(("tasks", 1, "agent", "harness")) == 4  # no agent: the task's own line
    assert doc.line(("tasks", 7)) == 2  # no such task: the list's line
    assert doc.where(("tasks", 0, "instruction")) == "t.yaml:3"
    assert doc.at(("tasks", 1, "runtime", "backend")) == "t.yaml:6: tasks[1].runtime.backend"
    assert doc.at((), "task") == "t.yaml:1: task"


def test_json_is_yaml_and_an_empty_file_has_no_line() -> None:
    doc = yamlpos.parse('{"task_id": "a",\n "instruction": 5}', "t.json")
    assert doc.data == {"task_id": "a", "instruction": 5} and doc.where(("instruction",)) == "t.json:2"
    empty = yamlpos.parse("", "e.yaml")
    assert empty.data is None and empty.line(("x",)) is None and empty.where(("x",)) == "e.yaml"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("a: [\n", "bad.yaml:1"),  # where the bracket opened, not the end where the parser gave up
        ("a: 1\n---\nb: 2\n", "bad.yaml:2"),
        ("a: !!python/object:os.system x\n", "bad.yaml:1"),
    ],
    ids=["unclosed", "two-documents", "unsafe-tag"],
)
def test_syntax_errors_name_the_line(text: str, where: str) -> None:
    with pytest.raises(yamlpos.YAMLSyntaxError) as info:
        yamlpos.parse(text, "bad.yaml")
    assert info.value.where == where and str(info.value).startswith(f"{where}: ")


def test_field_paths_both_ways() -> None:
    loc = ("tasks", 1, "runtime", "prepare", 0, "cmd")
    assert yamlpos.field_path(loc) == "tasks[1].runtime.prepare[0].cmd"
    assert yamlpos.parse_field_path("tasks[1].runtime.prepare[0].cmd") == loc
    assert yamlpos.field_path(()) == "" and yamlpos.field_path((0, "a")) == "[0].a"


@given(st.lists(st.one_of(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), st.integers(0, 99)), max_size=6))
def test_parse_field_path_inverts_field_path(loc: list[str | int]) -> None:
    if loc and isinstance(loc[0], int):
        loc = ["root", *loc]
    assert yamlpos.parse_field_path(yamlpos.field_path(tuple(loc))) == tuple(loc)
