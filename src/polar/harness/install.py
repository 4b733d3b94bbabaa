"""Pinned harness programs, installed once per node into a shared, read-only-used cache.

A preset pins its CLI's version. The first session on a node installs it (npm for the JS CLIs, pip for
Python harnesses) into `$POLAR_HOME/tools/<kind>/<package>@<version>`; every later session reuses that
prefix, and sandboxed runtimes see it read-only. Installs go to a temporary folder renamed into place, under
a file lock, so concurrent sessions never see half an install.

`POLAR_TOOL_VERSIONS` (JSON, package -> version) installs and runs other releases than the pins, with the
presets unchanged: how `scripts/compat` tries each new release (docs/compatibility.md).

A Python program that needs another Python than the node's (OpenHands: 3.12 only) gets a private copy of a
CPython of that version found on the node, with the program installed into the copy's own site-packages
(`python_prefix`): the copy is in the tool cache, which every sandbox sees, where the interpreter it was
copied from may be under a home directory a sandbox hides.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from polar.runtime.sandbox import tools_home as tools_home


class InstallError(RuntimeError):
    """A pinned program could not be installed (no registry, a bad version, a failed build)."""


def version_of(package: str, pinned: str) -> str:
    """The release of `package` to use: the pin, unless POLAR_TOOL_VERSIONS names another."""
    raw = os.environ.get("POLAR_TOOL_VERSIONS")
    if not raw:
        return pinned
    try:
        chosen = json.loads(raw)
    except json.JSONDecodeError:
        raise InstallError(f"POLAR_TOOL_VERSIONS is not JSON (package -> version): {raw!r}") from None
    if not isinstance(chosen, dict) or not all(isinstance(v, str) for v in chosen.values()):
        raise InstallError(f"POLAR_TOOL_VERSIONS must map package names to version strings: {raw!r}")
    return str(chosen.get(package, pinned))


def _shared(prefix: Path) -> Path:
    """`prefix` readable and traversable by everyone: sandboxes run the program as an unprivileged uid of
    their own, and `mkdtemp` made the folder 0700 (caches installed before this was fixed are mended on
    their next use)."""
    if prefix.stat().st_mode & 0o005 != 0o005:
        prefix.chmod(0o755)
    return prefix


def _install(kind: str, spec: str, build: Callable[[Path], None], root: Path | None) -> Path:
    """Run `build` into a fresh folder and move it to its cached place."""
    final = (root or tools_home()) / kind / spec.replace("/", "__")
    if (final / ".polar-installed").exists():
        return _shared(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".polar-installed").exists():  # another process finished it while we waited
            return _shared(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            build(tmp)
            (tmp / ".polar-installed").write_text(spec + "\n")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _shared(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _run(spec: str, command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Run one install step; its stdout, or InstallError with the tail of what it said."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise InstallError(f"installing {spec} took longer than {timeout_s:g} s") from None
    except FileNotFoundError as exc:
        raise InstallError(f"installing {spec} needs {exc.filename}, which is not on PATH") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise InstallError(f"installing {spec} failed ({proc.returncode}): {tail}")
    return proc.stdout


def _command(spec: str, command: list[str], timeout_s: float) -> Callable[[Path], None]:
    """A build step running `command` with `{prefix}` replaced by the fresh folder."""

    def build(tmp: Path) -> None:
        _run(spec, [a.replace("{prefix}", str(tmp)) for a in command], timeout_s)

    return build


def npm_prefix(package: str, version: str, *, root: Path | None = None, timeout_s: float = 900) -> Path:
    """The npm prefix holding `package@version` (its binaries are in `<prefix>/node_modules/.bin`)."""
    spec = f"{package}@{version_of(package, version)}"
    command = ["npm", "install", "--prefix", "{prefix}", "--no-audit", "--no-fund", "--omit=dev", spec]
    return _install("npm", spec, _command(spec, command, timeout_s), root)


def npm_bin(package: str, version: str, binary: str, *, root: Path | None = None) -> Path:
    path = npm_prefix(package, version, root=root) / "node_modules" / ".bin" / binary
    if not path.exists():
        raise InstallError(f"{package}@{version_of(package, version)} installed no binary named {binary!r}")
    return path


def pip_prefix(
    package: str, version: str, *, root: Path | None = None, timeout_s: float = 900, deps: bool = True
) -> Path:
    """A `--target` folder holding `package==version` and its dependencies (put it on PYTHONPATH); with
    `deps=False` the package alone, its imports served by the running environment's packages."""
    spec = f"{package}=={version_of(package, version)}"
    command = [sys.executable, "-m", "pip", "install", "-q", "--target", "{prefix}", spec]
    if not deps:
        command.insert(4, "--no-deps")
    return _install("pip" if deps else "pip-nodeps", spec, _command(spec, command, timeout_s), root)


async def npm_bin_async(package: str, version: str, binary: str, *, root: Path | None = None) -> Path:
    """`npm_bin` off the event loop (a first install takes seconds)."""
    return await asyncio.to_thread(npm_bin, package, version, binary, root=root)


# -- another Python than the node's ------------------------------------------------------------------------
_VERSION_OF = "import sys; print('%d.%d' % sys.version_info[:2])"
# What a copy needs to know of the interpreter it copies (run by that interpreter).
_LAYOUT = (
    "import json, sys, sysconfig; v = sysconfig.get_config_var; print(json.dumps({"
    "'executable': sys.executable, 'stdlib': sysconfig.get_path('stdlib'), 'libdir': v('LIBDIR'), "
    "'soname': v('INSTSONAME') if v('Py_ENABLE_SHARED') else None}))"
)
# Left out of the copy: the test suite (a third of a CPython install) and the installed packages.
_NOT_COPIED = shutil.ignore_patterns("test", "site-packages", "dist-packages")


def _pythons(minor: str) -> list[Path]:
    """Where a CPython `minor` may be on a node: `pythonX.Y` on PATH, then pyenv's and uv's installs."""
    found = [Path(p) for p in [shutil.which(f"python{minor}")] if p]
    home = Path.home()
    pyenv = Path(os.environ.get("PYENV_ROOT") or home / ".pyenv") / "versions"
    uv = Path(os.environ.get("UV_PYTHON_INSTALL_DIR") or home / ".local/share/uv/python")
    for base, pattern in (
        (pyenv, f"{minor}.*/bin/python{minor}"),
        (uv, f"cpython-{minor}.*/bin/python{minor}"),
    ):
        found += sorted(base.glob(pattern), key=_newest_first)
    return found


def _newest_first(path: Path) -> tuple[int, ...]:
    """pyenv's `3.12.10` before `3.12.9`; uv's `cpython-3.12.10-linux-...` likewise."""
    name = path.parents[1].name.removeprefix("cpython-").split("-")[0]
    return tuple(-int(p) for p in name.split(".") if p.isdigit())


def find_python(minor: str, path: str | None = None) -> Path:
    """A CPython `minor` ("3.12") interpreter on this node: `path` when given, else the first of
    `_pythons` that runs and says it is that version (pyenv's shims are on PATH but fail for a version
    that is installed and not selected)."""
    candidates = [Path(path)] if path else _pythons(minor)
    for candidate in candidates:
        try:
            done = subprocess.run(
                [str(candidate), "-c", _VERSION_OF], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == minor:
            return candidate
    tried = ", ".join(map(str, candidates)) or f"python{minor} on PATH, pyenv's and uv's installs"
    raise InstallError(f"no Python {minor} found on this node (tried {tried})")


def python_env(prefix: Path) -> dict[str, str]:
    """What a `python_prefix` copy runs with: its libpython, where the interpreter was built shared (the
    dynamic linker would look for it in the original's folder, which a sandbox may hide)."""
    shared = any((prefix / "lib").glob("libpython*.so*"))
    return {"LD_LIBRARY_PATH": str(prefix / "lib")} if shared else {}


def python_binary(prefix: Path) -> Path:
    """The interpreter of a `python_prefix` copy."""
    (binary,) = sorted((prefix / "bin").glob("python3.*[0-9]"))
    return binary


def _copy_python(spec: str, python: Path, dst: Path) -> Path:
    """Copy `python`'s binary, standard library and libpython into `dst` (bin/, lib/); its own prefix
    is then `dst` (CPython finds its library next to its binary), which the copy is checked for."""
    layout = json.loads(_run(spec, [str(python), "-c", _LAYOUT], 60))
    stdlib = Path(layout["stdlib"])
    (dst / "bin").mkdir()
    binary = dst / "bin" / stdlib.name  # python3.12
    shutil.copy2(os.path.realpath(layout["executable"]), binary)
    shutil.copytree(stdlib, dst / "lib" / stdlib.name, symlinks=True, ignore=_NOT_COPIED)
    if layout["soname"]:
        shutil.copy2(
            os.path.realpath(Path(layout["libdir"]) / layout["soname"]), dst / "lib" / layout["soname"]
        )
    env = {**os.environ, **python_env(dst), "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    seen = _run(spec, [str(binary), "-c", "import sys, ssl, sqlite3; print(sys.prefix)"], 60, env).strip()
    if Path(seen) != dst:
        raise InstallError(
            f"installing {spec}: the copy of {python} takes its library from {seen}, not {dst}"
        )
    return binary


def python_prefix(
    package: str, version: str, python: Path, *, root: Path | None = None, timeout_s: float = 1800
) -> Path:
    """A private copy of the CPython `python` with `package==version` installed into its own
    site-packages (run `python_binary(prefix)` with `python_env(prefix)`): no PYTHONPATH, which would leak
    into every Python the program starts, a shell tool's included."""
    spec = f"{package}=={version_of(package, version)}"

    def build(tmp: Path) -> None:
        binary = _copy_python(spec, python, tmp)
        env = {**os.environ, **python_env(tmp), "PYTHONNOUSERSITE": "1"}
        env.pop("PYTHONPATH", None)
        _run(spec, [str(binary), "-m", "ensurepip", "--default-pip"], timeout_s, env)
        pip = [str(binary), "-m", "pip", "install", "-q", "--no-warn-script-location", spec]
        _run(spec, pip, timeout_s, env)

    return _install("python", spec, build, root)
