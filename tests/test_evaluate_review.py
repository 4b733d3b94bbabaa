# ruff: noqa: F811  (`make_repo` is a fixture imported from tests.evaluate_support)
"""The diff review (`polar.evaluate.review`): the rules on their own, and the facts read from real git in a
real runtime, file names that quoting would garble included."""

from __future__ import annotations

import base64
import os
import string
import sys
from collections.abc import Set as AbstractSet

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar.evaluate import review
from polar.evaluate.review import SHADOWED, Finding, Tree
from tests.evaluate_support import make_repo, must  # noqa: F401  (make_repo is a fixture)


def tree(
    *,
    added: AbstractSet[str] = frozenset(),
    modified: AbstractSet[str] = frozenset(),
    deleted: AbstractSet[str] = frozenset(),
    files: AbstractSet[str] = frozenset(),
    protected: AbstractSet[str] = frozenset(),
    protected_files: AbstractSet[str] = frozenset({"tests/test_a.py", "tests/__init__.py"}),
    links: dict[str, str] | None = None,
) -> Tree:
    return Tree(
        added=frozenset(added),
        modified=frozenset(modified),
        deleted=frozenset(deleted),
        files=frozenset(files) | frozenset(added) | frozenset(modified),
        protected_changes=frozenset(protected),
        protected_files=frozenset(protected_files),
        links=links or {},
    )


def whys(t: Tree, **kw: object) -> dict[str, str]:
    return {f.path: f.why for f in review.review(t, **kw)}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("t", "path", "why"),
    [
        (tree(added={"unittest/__init__.py", "unittest/__main__.py"}), "unittest/__init__.py", "'unittest'"),
        (tree(added={"unittest/__main__.py"}), "unittest/__main__.py", "'unittest'"),  # a namespace package
        (tree(added={"pytest.py"}), "pytest.py", "'pytest'"),
        (tree(added={"_pytest/runner.py"}), "_pytest/runner.py", "'_pytest'"),
        (tree(added={"json.py"}), "json.py", "'json'"),
        (tree(added={"src/os/__init__.py"}), "src/os/__init__.py", "'os'"),  # src/ may be on sys.path
        (tree(added={"tests/unittest.py"}), "tests/unittest.py", "'unittest'"),
        (tree(added={"_socket.cpython-311-x86_64-linux-gnu.so"}), "_socket.cpython-311-x86_64-linux-gnu.so", "'_socket'"),
        (tree(added={"pytest_evil.py"}), "pytest_evil.py", "'pytest_evil'"),
        (tree(added={"conftest.py"}), "conftest.py", "conftest.py is loaded"),
        (tree(modified={"tests/conftest.py"}), "tests/conftest.py", "conftest.py is loaded"),
        (tree(deleted={"conftest.py"}), "conftest.py", "conftest.py is loaded"),
        (tree(added={"lib/sitecustomize.py"}), "lib/sitecustomize.py", "sitecustomize.py is loaded"),
        (tree(added={"usercustomize.py"}), "usercustomize.py", "usercustomize.py is loaded"),
        (tree(added={"venv/lib/site-packages/evil.pth"}), "venv/lib/site-packages/evil.pth", "evil.pth is loaded"),
        (tree(added={"x.dist-info/entry_points.txt"}), "x.dist-info/entry_points.txt", "entry_points.txt"),
        (tree(added={"pytest.ini"}), "pytest.ini", "configures the test runner"),
        (tree(modified={"pyproject.toml"}), "pyproject.toml", "configures the test runner"),
        (tree(modified={"setup.cfg"}), "setup.cfg", "configures the test runner"),
        (tree(protected={"tests/test_a.py"}), "tests/test_a.py", "touches a protected path"),
        (tree(added={"l"}, links={"l": "/etc/passwd"}), "l", "absolute path"),
        (tree(added={"d/l"}, links={"d/l": "../../outside"}), "d/l", "leaves the repository"),
        (tree(added={"l"}, links={"l": "tests/test_a.py"}), "l", "into a protected path"),
        (tree(added={"l"}, links={"l": "tests"}), "l", "into a protected path"),
        (tree(added={"d/l"}, links={"d/l": "../tests/./test_a.py"}), "d/l", "into a protected path"),
    ],
)  # fmt: skip
def test_what_is_refused(t: Tree, path: str, why: str) -> None:
    found = whys(t)
    assert why in found[path], found


@pytest.mark.parametrize(
    "t",
    [
        tree(modified={"json.py"}),  # the task's own module named like the standard library's
        tree(added={"pkg/json.py", "pkg/__init__.py"}),  # not top level: inside a package
        tree(added={"pkg/unittest/__init__.py"}, files={"pkg/__init__.py"}),
        tree(added={"stats_helpers.py", "docs/notes.md", "data/blob.bin"}),
        tree(modified={"stats.py"}, deleted={"old.py"}),
        tree(added={"l"}, links={"l": "stats.py"}),  # a symlink inside the repository
        tree(added={"d/l"}, links={"d/l": "../stats.py"}),
        tree(added={"test.py", "tests/helpers.py"}),  # `test` is no standard-library module name
    ],
)
def test_what_is_allowed(t: Tree) -> None:
    assert review.review(t) == []


def test_config_files_are_a_knob() -> None:
    t = tree(modified={"pyproject.toml", "tox.ini"})
    assert set(whys(t)) == {"pyproject.toml", "tox.ini"}
    assert whys(t, config_files=["tox.ini"]) == {
        "tox.ini": "tox.ini configures the test runner (evaluator.config.config_files)"
    }
    assert whys(t, config_files=[]) == {}


def test_one_finding_per_path_in_order_and_the_reason() -> None:
    findings = review.review(
        tree(added={"conftest.py", "unittest/__init__.py"}, protected={"tests/test_a.py"})
    )
    assert [f.path for f in findings] == ["conftest.py", "tests/test_a.py", "unittest/__init__.py"]
    assert review.refusal(findings) == "refused: conftest.py: " + findings[0].why + " (and 2 more)"
    assert review.refusal([Finding("a", "b")]) == "refused: a: b"
    many = [Finding(f"tests/t{i}.py", "touches a protected path") for i in range(120)]
    assert len(review.refused(many)["refused"]) == 50 and "(and 119 more)" in review.refused(many)["reason"]


_dirs = st.lists(
    st.text(string.ascii_lowercase, min_size=1, max_size=8).filter(lambda d: d not in SHADOWED), max_size=3
)


@settings(max_examples=200)
@given(
    _dirs,
    st.sampled_from(sorted(n for n in SHADOWED if n.isidentifier())),
    st.sampled_from(["/__init__.py", "/x.py", ".py", ".pyc", "/"]),
)
def test_any_top_level_shadowing_name_is_refused(dirs: list[str], name: str, tail: str) -> None:
    path = "/".join([*dirs, name]) + (tail if tail != "/" else "/data.txt")
    assert review.shadows(path, frozenset()) == name  # from any directory that is no package
    assert review.review(tree(added={path})) != []
    # Inside a package (its directory has an __init__.py after the diff) the name is not top level.
    if dirs:
        inits = frozenset(f"{'/'.join(dirs[: i + 1])}/__init__.py" for i in range(len(dirs)))
        assert review.shadows(path, inits) is None


@settings(max_examples=200)
@given(st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True))
def test_other_names_are_not_shadowing(name: str) -> None:
    if name in SHADOWED or name.startswith("pytest_"):
        return
    assert review.shadows(f"{name}.py", frozenset()) is None
    assert review.shadows(f"{name}/__init__.py", frozenset()) is None


def test_stdlib_names_come_from_the_interpreter() -> None:
    assert {"json", "os", "unittest", "sys"} <= SHADOWED and "test" not in sys.stdlib_module_names


# -- the facts, from real git in a real runtime ------------------------------------------------------------

NASTY = [
    "sp ace.py",
    'quo"te.py',
    "back\\slash.py",
    "new\nline.py",
    "tab\there.py",
    "-dash.py",
    "ünïcode.py",
    "deep/er/file.py",
]


async def test_inspect_reads_every_name_exactly(make_repo) -> None:
    fresh = await make_repo(
        {"stats.py": "x = 1\n", "gone.py": "", "tests/__init__.py": "", "tests/test_a.py": ""}
    )
    start = await review.before(fresh, 60)
    assert start.untracked == frozenset() and start.ref == "HEAD"  # a clean tree compares with its commit
    work = fresh.workdir
    for name in NASTY:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("y = 2\n")
    raw_name = b"raw-\xff.py"  # not UTF-8
    with open(os.fsencode(work) + b"/" + raw_name, "w") as f:
        f.write("z")
    (work / "stats.py").write_text("x = 2\n")
    (work / "gone.py").unlink()
    (work / "tests" / "test_a.py").write_text("changed\n")
    (work / "link").symlink_to("tests/test_a.py")
    got = await review.inspect(fresh, start, ["tests"], 60)
    assert got.modified == {"stats.py", "tests/test_a.py"}
    assert got.deleted == {"gone.py"}
    assert set(NASTY) <= got.added and raw_name.decode("utf-8", "surrogateescape") in got.added
    assert got.protected_changes == {"tests/test_a.py"}
    assert got.protected_files == {"tests/__init__.py", "tests/test_a.py"}
    assert got.links == {"link": "tests/test_a.py"}
    assert "gone.py" not in got.files and "stats.py" in got.files
    assert whys(got)["link"].startswith("a symlink into a protected path")


async def test_a_set_up_that_changed_tracked_files_is_not_the_diff(make_repo) -> None:
    """An image whose set-up changed tracked files (a SWE-bench install) is compared with itself."""
    fresh = await make_repo({"setup.cfg": "[a]\n", "m.py": ""})
    (fresh.workdir / "setup.cfg").write_text("[a]\nchanged by the image\n")
    (fresh.workdir / "build.log").write_text("")
    start = await review.before(fresh, 60)
    assert start.ref != "HEAD" and start.untracked == {"build.log"}
    (fresh.workdir / "m.py").write_text("fixed\n")
    got = await review.inspect(fresh, start, [], 60)
    assert got.modified == {"m.py"} and got.added == frozenset()
    assert review.review(got) == []


async def test_restore_checks_the_protected_paths_out_again(make_repo) -> None:
    fresh = await make_repo({"tests/__init__.py": "", "tests/test_a.py": "real\n", "m.py": ""})
    (fresh.workdir / "tests" / "test_a.py").write_text("forged\n")
    await review.restore(fresh, "polar-base", ["tests", ":(literal)no/such/path"], 60)
    assert (fresh.workdir / "tests" / "test_a.py").read_text() == "real\n"


def test_parse_raw_takes_names_verbatim() -> None:
    blob = (
        b":100644 100644 "
        + b"a" * 40
        + b" "
        + b"0" * 40
        + b' M\0we\nird "name\0:000000 120000 '
        + b"0" * 40
        + b" "
        + b"b" * 40
        + b" A\0l\0"
    )
    assert review.parse_raw(blob) == [("M", "100644", 'we\nird "name'), ("A", "120000", "l")]
    assert base64.b64decode(base64.b64encode(blob)) == blob
