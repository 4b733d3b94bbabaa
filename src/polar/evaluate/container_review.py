"""What the agent changed in a container, reviewed before a Harbor verifier runs on it.

A Harbor verifier (`tests/test.sh`) runs in the agent's own container (`shared`) or in a fresh one that got
the agent's artifacts (`separate`), so files there can decide its verdict: a `pytest.py` where it runs
`python3 -m pytest`, a `.pth` in a site directory, a replaced `python3`. The engine lists every path the
container added (A), changed (C) or deleted (D) against its image (`ContainerRuntime.changed_paths`, read
from the host: nothing in the container can change the listing), and the review refuses (reward 0) a
change that is, with `polar.evaluate.review`'s names:

- an import hook: `conftest.py`, `sitecustomize.py`, `usercustomize.py`, a `.pth`, or an
  `entry_points.txt` that registers a pytest plugin (`[pytest11]`);
- a runner configuration file (`config_files`) where pytest looks for one: `/`, the workdir and above;
- a module or package named like a standard-library or test-framework module (`pytest.py`,
  `unittest/__init__.py`) added in a directory that is not a package;
- the interpreter: anything in its standard library (`/usr/lib/python3.11/`, `python311.zip`), an
  installed package changed, deleted or added to (`site-packages/_pytest/...`), a new one named as above,
  a `python*`, `pytest*`, `bash`, `sh` or `env` in a `bin` directory of the image;
- a system command (`/usr/bin`, `/usr/local/bin`, ...) changed or deleted, or a new one ahead of an
  existing one on PATH (`/usr/local/bin/mkdir`), and `/etc/ld.so.preload`.

Honest work passes: files anywhere else (the app in the workdir, /tmp, configuration in /etc), new
commands, new packages in a site directory (a `pip install` of what the image lacks), a virtual environment
of the agent's own (its `pyvenv.cfg` new: the verifier runs it only where the task says so) and bytecode
(`__pycache__/`: the verifier's Python reads none). Refused as well, the price of the rule: upgrading or
removing a package the image has, an editable install (its `.pth`), a test framework installed over the
image's. A task's own `prepare` changes are in the listing too (shared mode): such a task sets
`review: false` or grades in `separate` mode.
"""

from __future__ import annotations

import posixpath
import re
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from polar.evaluate.review import CONFIG_FILES, HOOK_SUFFIXES, Finding, module_name, shadowing
from polar.evaluate.support import EvaluatorError, tail
from polar.runtime.base import Runtime, RuntimeFailure

HOOKS = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py"})
SYSTEM_BIN = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")  # PATH order
# What runs the verifier, and what it runs by name, in a bin directory.
VERIFIER_COMMANDS = re.compile(r"(python|pytest|py\.test)[^/]*|bash|sh|dash|env")
_STDLIB = re.compile(r"(^|/)lib(64)?/python3[^/]*(/|$)")
_SITE = re.compile(r"/(site|dist)-packages(?=/|$)")
_PYTEST_PLUGIN = re.compile(r"^\s*\[\s*pytest11\s*\]", re.MULTILINE)
_ENTRY_POINTS_LIMIT = 100
_FACTS_TIMEOUT_S = 120.0


@dataclass
class Open:
    """What names alone do not decide: `check` pairs (path, another path) that make `path` a finding when
    the other one exists in the container (and is not the same file), or that clear it."""

    shadows: dict[str, str] = field(default_factory=dict)  # module -> the __init__.py that clears it
    commands: dict[str, list[str]] = field(default_factory=dict)  # new command -> the same name later on PATH
    entry_points: list[str] = field(default_factory=list)


def _under(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def _ancestors(path: str) -> list[str]:
    out = []
    while path not in ("/", ""):
        path = posixpath.dirname(path)
        out.append(path)
    return out


def _site(path: str) -> tuple[str, str] | None:
    """(site directory, path inside it) for a path under a site-packages or dist-packages directory."""
    matches = list(_SITE.finditer(path))
    if not matches:
        return None
    end = matches[-1].end()
    return path[:end], path[end + 1 :]


def judge(
    changes: Iterable[tuple[str, str]],
    workdir: str,
    config_files: Sequence[str] = CONFIG_FILES,
    within: Sequence[str] | None = None,
    skip: Sequence[str] = (),
) -> tuple[list[Finding], Open]:
    """The findings names decide, and what is left open. `within`: only paths under these count; `skip`:
    paths under these do not (what the evaluator empties and fills itself)."""
    kinds = dict((path, kind) for kind, path in changes)
    parents = {a for path in kinds for a in _ancestors(path)}
    # A virtual environment of the agent's own: its directory and pyvenv.cfg are new.
    venvs = [
        root
        for p, k in kinds.items()
        if k == "A" and p.endswith("/pyvenv.cfg") and kinds.get(root := posixpath.dirname(p)) == "A"
    ]
    config_dirs = {"/", workdir, *_ancestors(workdir)}
    configs = frozenset(config_files)
    found: dict[str, str] = {}
    left = Open()
    for path, kind in sorted(kinds.items()):
        if (
            path in parents  # a directory with listed contents: they are judged one by one
            or "__pycache__" in path.split("/")
            or (within is not None and not any(_under(path, w) for w in within))
            or any(_under(path, d) for d in skip)
            or any(_under(path, v) for v in venvs)
        ):
            continue
        why = _rule(path, kind, kinds, config_dirs, configs, left)
        if why is not None:
            found[path] = why
    return [Finding(p, found[p]) for p in sorted(found)], left


def _rule(
    path: str, kind: str, kinds: dict[str, str], config_dirs: set[str], configs: frozenset[str], left: Open
) -> str | None:
    base, parent = posixpath.basename(path), posixpath.dirname(path)
    verb = {"A": "adds", "C": "changes", "D": "deletes"}[kind]
    site = _site(path)
    if site is not None and site[1]:
        root, rel = site
        top = rel.split("/")[0]
        if "/" not in rel and (base.endswith(HOOK_SUFFIXES) or base in HOOKS):
            return f"{verb} {base} in a site directory, loaded by the interpreter on its own"
        if kind != "A":
            return f"{verb} a file of an installed package ({top})"
        if kinds.get(f"{root}/{top}") != "A":
            return f"adds a file to an installed package ({top})"
        name = module_name(top, "/" not in rel)
        if shadowing(name):
            return f"installs a module {name!r}, the name of a standard-library or test-framework module"
        if base == "entry_points.txt":
            left.entry_points.append(path)
        return None
    if site is None and _STDLIB.search(path):
        return f"{verb} a file of the interpreter's standard library"
    if path == "/etc/ld.so.preload":
        return f"{verb} /etc/ld.so.preload (a library loaded into every process)"
    if base == "pyvenv.cfg" and kinds.get(parent) != "A":
        return f"{verb} {base} in a directory of the image's (it configures the interpreter there)"
    if parent in SYSTEM_BIN:
        if kind != "A":
            return f"{verb} a system command"
        if VERIFIER_COMMANDS.fullmatch(base):
            return f"adds {base} to {parent}, ahead of or instead of the one the verifier runs"
        left.commands[path] = [f"{d}/{base}" for d in SYSTEM_BIN[SYSTEM_BIN.index(parent) + 1 :]]
        return None
    if parent.endswith(("/bin", "/sbin")) and kinds.get(parent) != "A" and VERIFIER_COMMANDS.fullmatch(base):
        return f"{verb} {base} in {parent}, a directory of the image's"
    if base in HOOKS or base.endswith(HOOK_SUFFIXES):
        return f"{verb} {base}, loaded by the test runner or the interpreter on its own"
    if base in configs and parent in config_dirs:
        return f"{verb} {base}, where it configures the test runner (evaluator.config.config_files)"
    if base == "entry_points.txt" and kind != "D":
        left.entry_points.append(path)
    if kind == "A":
        if shadowing(module_name(base, True)):
            left.shadows[path] = f"{parent.rstrip('/')}/__init__.py"
        elif base == "__init__.py" and shadowing(module_name(posixpath.basename(parent), False)):
            left.shadows[path] = f"{posixpath.dirname(parent).rstrip('/')}/__init__.py"
    return None


# Reads NUL-separated pairs (path, other): prints the index of each pair whose `other` exists and is not
# the same file as `path` (`-ef`: /bin is /usr/bin on a merged-/usr system).
_PRESENT = r"""
i=0
while IFS= read -r -d '' a && IFS= read -r -d '' b; do
  if [ -e "$b" ] && ! [ "$b" -ef "$a" ]; then echo "$i"; fi
  i=$((i + 1))
done
exit 0
"""


async def _present(runtime: Runtime, pairs: Sequence[tuple[str, str]]) -> set[int]:
    if not pairs:
        return set()
    stdin = b"".join(f"{a}\0{b}\0".encode("utf-8", "surrogateescape") for a, b in pairs)
    res = await runtime.exec(["bash", "-c", _PRESENT], cwd="/", stdin=stdin, timeout_s=_FACTS_TIMEOUT_S)
    if res.exit_code != 0 or res.timed_out:
        raise EvaluatorError(f"cannot look up paths in the container: {tail(res.stderr.strip(), 500)}")
    return {int(line) for line in res.stdout.split() if line.isdigit()}


async def _plugin_entry_points(runtime: Runtime, paths: Sequence[str]) -> dict[str, str]:
    """Each `entry_points.txt` that registers a pytest plugin (or cannot be read as a plain file)."""
    if len(paths) > _ENTRY_POINTS_LIMIT:
        return {
            p: f"one of {len(paths)} entry_points.txt files (at most {_ENTRY_POINTS_LIMIT} are read)"
            for p in paths
        }
    found = {}
    with tempfile.TemporaryDirectory(prefix="polar-review-") as tmp:
        for n, path in enumerate(paths):
            local = Path(tmp) / str(n)
            try:
                await runtime.download(path, local)
            except RuntimeFailure as exc:
                found[path] = f"an entry_points.txt that cannot be read: {tail(str(exc), 200)}"
                continue
            if local.is_symlink() or not local.is_file():
                found[path] = "an entry_points.txt that is not a plain file"
            elif _PYTEST_PLUGIN.search(local.read_bytes()[: 1 << 20].decode("utf-8", "replace")):
                found[path] = "an entry_points.txt that registers a pytest plugin ([pytest11])"
    return found


async def review_container(
    runtime: Runtime,
    changes: Iterable[tuple[str, str]],
    workdir: str,
    config_files: Sequence[str] = CONFIG_FILES,
    within: Sequence[str] | None = None,
    skip: Sequence[str] = (),
) -> list[Finding]:
    """Every reason to refuse what `changes` (from `runtime`'s engine) did, one per path, in path order
    (`judge` says which count). What names leave open is looked up in `runtime` only when names found
    nothing."""
    findings, left = judge(changes, workdir, config_files, within, skip)
    if findings:
        return findings
    shadows = list(left.shadows.items())
    commands = [(p, other) for p, others in left.commands.items() for other in others]
    present = await _present(runtime, shadows + commands)
    found: dict[str, str] = {}
    for i, (path, _) in enumerate(shadows):
        if i not in present:  # no __init__.py beside it: a top-level module
            found[path] = "adds a top-level module named like a standard-library or test-framework module"
    for i, (path, other) in enumerate(commands, start=len(shadows)):
        if i in present:
            found.setdefault(path, f"adds a command ahead of {other} on PATH")
    found.update(await _plugin_entry_points(runtime, left.entry_points))
    return [Finding(p, found[p]) for p in sorted(found)]


def system_changes(changes: Iterable[tuple[str, str]], workdir: str) -> list[str]:
    """Paths the agent changed or deleted that a command in its container needs to start: system
    commands and libraries, and the workdir itself (what makes `bash` exit 126 or 127 there)."""
    roots = (
        "/bin",
        "/sbin",
        "/lib",
        "/lib64",
        "/usr/bin",
        "/usr/sbin",
        "/usr/lib",
        "/usr/lib64",
        "/usr/local/bin",
    )
    kinds = {path: kind for kind, path in changes}
    parents = {a for path in kinds for a in _ancestors(path)}
    return sorted(
        p
        for p, k in kinds.items()
        if k != "A" and p not in parents and (any(_under(p, r) for r in roots) or _under(workdir, p))
    )
