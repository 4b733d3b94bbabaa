"""What an agent's diff may not do, decided from the tree the diff made in the evaluator's fresh runtime.

A test verdict must come from the task, never from code the agent wrote that the runner loads before or
around the tests. So a diff is refused (reward 0, `details["refused"]` names each path and why) when it:

- touches a protected path (`protect`: the tests, what they read);
- adds, changes or deletes a file a test runner or Python's start-up loads on its own: `conftest.py`,
  `sitecustomize.py`, `usercustomize.py`, `*.pth`, `entry_points.txt` (installed pytest plugins), or a
  runner configuration file (`config_files`: pytest.ini, tox.ini, setup.cfg, pyproject.toml, ...);
- adds a module or package importable at top level (its directory has no `__init__.py` after the diff,
  so it may be on `sys.path`) named like a standard-library module or a test framework (`unittest/`,
  `pytest.py`): changing such a file the task already has is allowed;
- adds a symlink whose target is absolute, leaves the repository, or points into a protected path.

The facts come from the fresh runtime's own git, run after `git apply` and before anything of the tree
runs (applying executes nothing): `git diff --raw -z` against the base for tracked paths, the untracked
files that were not there before the diff, pathspec matching for `protect` done by git itself, and link
targets from `readlink`. Each listing travels base64-encoded, so no file name (quotes, newlines, bytes that
are not UTF-8) is misread.
"""

from __future__ import annotations

import base64
import posixpath
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polar.evaluate.support import EvaluatorError, tail
from polar.runtime.base import Runtime

# Files a runner or the interpreter loads by name, wherever the agent put them.
IMPORT_HOOKS = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py", "entry_points.txt"})
HOOK_SUFFIXES = (".pth",)
# Runner configuration: addopts, plugins, test paths, rootdir. A real fix rarely needs them (a knob).
CONFIG_FILES = ("pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
# Top-level names a runner imports besides the standard library's.
FRAMEWORKS = frozenset(
    {"unittest", "pytest", "_pytest", "pluggy", "py", "nose", "nose2", "hypothesis", "_hypothesis_pytestplugin",
     "coverage", "iniconfig", "xdist", "mock", "polar"}
)  # fmt: skip
SHADOWED = frozenset(sys.stdlib_module_names) | FRAMEWORKS
MODULE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".so", ".pyd")
# Build products never travel in a diff: a stale unchecked-hash .pyc, or a sourceless `unittest.pyc`, would
# stand in for a module whose source says otherwise.
BUILD_PRODUCTS = (":(exclude,glob)**/__pycache__/**", ":(exclude,glob)**/*.pyc", ":(exclude,glob)**/*.pyo")


@dataclass(frozen=True)
class Finding:
    path: str
    why: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "why": self.why}


@dataclass(frozen=True)
class Tree:
    """What the diff did, as the fresh runtime's git sees it (paths relative to the workdir)."""

    added: frozenset[str]  # new files, tracked or not
    modified: frozenset[str]
    deleted: frozenset[str]
    files: frozenset[str]  # every file after the diff
    protected_changes: frozenset[str]
    protected_files: frozenset[str]  # what `protect` matches after the diff
    links: Mapping[str, str]  # symlinks the diff added or changed -> their targets

    @property
    def changed(self) -> frozenset[str]:
        return self.added | self.modified | self.deleted


def module_name(part: str, last: bool) -> str | None:
    """The top-level import name a path component gives, if any."""
    if not last:
        return part if part.isidentifier() else None
    for suffix in MODULE_SUFFIXES:
        if part.endswith(suffix):
            stem = part.split(".", 1)[0]  # foo.cpython-311-x86_64-linux-gnu.so -> foo
            return stem if stem.isidentifier() else None
    return None


def shadowing(name: str | None) -> bool:
    """Whether a top-level import name is a standard-library or test-framework module's (or a pytest
    plugin's, `pytest_*`)."""
    return name is not None and (name in SHADOWED or name.startswith("pytest_"))


def shadows(path: str, files: Iterable[str] | frozenset[str]) -> str | None:
    """The shadowed name, when `path` makes a module importable at top level (from a directory that is not
    a package after the diff) under a standard-library or test-framework name."""
    present = files if isinstance(files, frozenset) else frozenset(files)
    parts = path.split("/")
    for i, part in enumerate(parts):
        parent = "/".join(parts[:i])
        if parent and f"{parent}/__init__.py" in present:
            continue
        name = module_name(part, i == len(parts) - 1)
        if shadowing(name):
            return name
    return None


def _inside(target: str, protected: frozenset[str]) -> bool:
    return target in protected or any(
        p.startswith(target + "/") or target.startswith(p + "/") for p in protected
    )


def review(tree: Tree, config_files: Sequence[str] = CONFIG_FILES) -> list[Finding]:
    """Every reason to refuse the diff, one per path (the first rule that applies), in path order."""
    configs = frozenset(config_files)
    found: dict[str, str] = {}

    def add(path: str, why: str) -> None:
        found.setdefault(path, why)

    for path in tree.protected_changes:
        add(path, "touches a protected path")
    for path in tree.changed:
        base = posixpath.basename(path)
        if base in IMPORT_HOOKS or base.endswith(HOOK_SUFFIXES):
            add(path, f"{base} is loaded by the test runner or the interpreter on its own")
        elif base in configs:
            add(path, f"{base} configures the test runner (evaluator.config.config_files)")
    for path in tree.added:
        name = shadows(path, tree.files)
        if name is not None:
            add(
                path,
                f"adds a top-level module {name!r}, the name of a standard-library or test-framework module",
            )
    for path, target in tree.links.items():
        if target.startswith("/"):
            add(path, f"a symlink to an absolute path ({target})")
            continue
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
        if resolved == ".." or resolved.startswith("../"):
            add(path, f"a symlink that leaves the repository ({target})")
        elif _inside(resolved, tree.protected_files):
            add(path, f"a symlink into a protected path ({target})")
    return [Finding(p, found[p]) for p in sorted(found)]


def refusal(findings: Sequence[Finding]) -> str:
    first = findings[0]
    more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
    return f"refused: {first.path}: {first.why}{more}"


def refused(findings: Sequence[Finding], limit: int = 50) -> dict[str, Any]:
    """The details of a refusal: the reason, and the first `limit` paths with why."""
    return {"reason": refusal(findings), "refused": [f.as_dict() for f in findings[:limit]]}


# -- facts from the fresh runtime -------------------------------------------------------------------------

_LISTINGS = r"""
set -o pipefail
base=$1; shift
b64() { base64 -w0 && echo; }
git diff --raw -z --no-renames --no-abbrev --no-ext-diff --ignore-submodules=none "$base" -- | b64
git ls-files -z -o | b64
git ls-files -z | b64
if [ $# -gt 0 ]; then
  git diff --raw -z --no-renames --no-abbrev --no-ext-diff "$base" -- "$@" | b64
  git ls-files -z -o -- "$@" | b64
  git ls-files -z -- "$@" | b64
else
  echo; echo; echo
fi
"""
_LINKS = r"""
while IFS= read -r -d '' p; do
  if [ -L "$p" ]; then printf '%s\0%s\0' "$p" "$(readlink -- "$p")"; fi
done | base64 -w0
"""


def _names(blob: bytes) -> list[str]:
    return [p.decode("utf-8", "surrogateescape") for p in blob.split(b"\0") if p]


def parse_raw(blob: bytes) -> list[tuple[str, str, str]]:
    """`git diff --raw -z --no-renames` output as (status letter, new mode, path)."""
    fields = blob.split(b"\0")
    out = []
    i = 0
    while i + 1 < len(fields) and fields[i]:
        meta = fields[i].decode("ascii").lstrip(":").split()
        if len(meta) != 5:
            raise EvaluatorError(f"unexpected `git diff --raw` output: {fields[i][:200]!r}")
        out.append((meta[4][:1], meta[1], fields[i + 1].decode("utf-8", "surrogateescape")))
        i += 2
    return out


@dataclass(frozen=True)
class Before:
    """The fresh runtime's workdir before the diff: its untracked files (ignored ones included) and a
    commit of its tracked state (`git stash create`, else HEAD): what the diff changed is measured from
    there, so neither an image whose set-up changed tracked files (a SWE-bench install) nor a task whose
    prepare committed past `base_ref` is taken for the agent's doing."""

    untracked: frozenset[str]
    ref: str


_BEFORE = r"""
set -o pipefail
git ls-files -z -o | base64 -w0 && echo
git -c user.name=polar -c user.email=polar@localhost stash create
"""


async def before(fresh: Runtime, timeout_s: float) -> Before:
    res = await fresh.exec(["bash", "-c", _BEFORE], timeout_s=timeout_s)
    lines = res.stdout.split("\n")
    if res.exit_code != 0 or res.timed_out or len(lines) < 2:
        raise EvaluatorError(f"cannot read the fresh runtime's workdir: {tail(res.stderr.strip(), 500)}")
    untracked = frozenset(_names(base64.b64decode(lines[0])))
    return Before(untracked=untracked, ref=lines[1].strip() or "HEAD")


async def inspect(fresh: Runtime, start: Before, protect: Sequence[str], timeout_s: float) -> Tree:
    """What the applied diff changed in `fresh` since `start`."""
    res = await fresh.exec(
        ["bash", "-c", _LISTINGS, "polar-review", start.ref, *protect], timeout_s=timeout_s
    )
    lines = res.stdout.split("\n")
    if res.exit_code != 0 or res.timed_out or len(lines) < 6:
        raise EvaluatorError(
            f"cannot list what the diff changed (exit {res.exit_code}): {tail(res.stderr.strip(), 500)}"
        )
    raw, others, index, p_raw, p_others, p_index = (base64.b64decode(x) for x in lines[:6])
    added: set[str] = set()
    modified: set[str] = set()
    deleted: set[str] = set()
    links: set[str] = set()
    for status, mode, path in parse_raw(raw):
        {"A": added, "D": deleted}.get(status, modified).add(path)
        if mode == "120000":
            links.add(path)
    now_untracked = frozenset(_names(others))
    new = now_untracked - start.untracked
    added |= new
    files = (frozenset(_names(index)) - deleted) | now_untracked
    protected_changes = {p for _, _, p in parse_raw(p_raw)} | (frozenset(_names(p_others)) - start.untracked)
    targets = await _link_targets(fresh, sorted(new | links), timeout_s)
    return Tree(
        added=frozenset(added),
        modified=frozenset(modified),
        deleted=frozenset(deleted),
        files=files,
        protected_changes=frozenset(protected_changes),
        protected_files=frozenset(_names(p_index)) | frozenset(_names(p_others)),
        links=targets,
    )


async def _link_targets(fresh: Runtime, paths: Sequence[str], timeout_s: float) -> dict[str, str]:
    if not paths:
        return {}
    stdin = b"".join(p.encode("utf-8", "surrogateescape") + b"\0" for p in paths)
    res = await fresh.exec(["bash", "-c", _LINKS], stdin=stdin, timeout_s=timeout_s)
    if res.exit_code != 0 or res.timed_out:
        raise EvaluatorError(f"cannot read the diff's symlinks: {tail(res.stderr.strip(), 500)}")
    names = _names(base64.b64decode(res.stdout.strip()))
    return dict(zip(names[::2], names[1::2], strict=False))


_RESTORE = r"""
base=$1; shift; rc=0
for spec in "$@"; do
  out=$(git checkout -q "$base" -- "$spec" 2>&1) || case "$out" in
    *"did not match any file"*) ;;
    *) printf '%s\n' "$out" >&2; rc=1 ;;
  esac
done
exit $rc
"""


async def restore(fresh: Runtime, base_ref: str, protect: Sequence[str], timeout_s: float) -> None:
    """Check the protected paths out of `base_ref` again, one pathspec at a time (the review refused any
    diff touching them; this holds even where a pathspec and the review disagree)."""
    if not protect:
        return
    res = await fresh.exec(["bash", "-c", _RESTORE, "polar-restore", base_ref, *protect], timeout_s=timeout_s)
    if res.exit_code != 0 or res.timed_out:
        raise EvaluatorError(
            f"cannot restore the protected paths {shlex.join(protect)}: {tail(res.stderr.strip(), 500)}"
        )
