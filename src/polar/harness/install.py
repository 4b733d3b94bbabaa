"""Pinned harness programs, installed once per node into a shared, read-only-used cache.

A preset pins its CLI's version. The first session on a node installs it (npm for the JS CLIs, pip for
Python harnesses) into `$POLAR_HOME/tools/<kind>/<package>@<version>`; every later session reuses that
prefix, and sandboxed runtimes see it read-only. Installs go to a temporary folder renamed into place, under
a file lock, so concurrent sessions never see half an install.

`POLAR_TOOL_VERSIONS` (JSON, package -> version) installs and runs other releases than the pins, with the
presets unchanged: how `scripts/compat` tries each new release (docs/compatibility.md).
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


def _install(kind: str, spec: str, command: list[str], root: Path | None, timeout_s: float) -> Path:
    """Run `command` (with `{prefix}` replaced) into a fresh folder and move it to its cached place."""
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
            argv = [a.replace("{prefix}", str(tmp)) for a in command]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip()[-2000:]
                raise InstallError(f"installing {spec} failed ({proc.returncode}): {tail}")
            (tmp / ".polar-installed").write_text(spec + "\n")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _shared(final)
        except subprocess.TimeoutExpired:
            raise InstallError(f"installing {spec} took longer than {timeout_s:g} s") from None
        except FileNotFoundError as exc:
            raise InstallError(f"installing {spec} needs {exc.filename}, which is not on PATH") from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def npm_prefix(package: str, version: str, *, root: Path | None = None, timeout_s: float = 900) -> Path:
    """The npm prefix holding `package@version` (its binaries are in `<prefix>/node_modules/.bin`)."""
    spec = f"{package}@{version_of(package, version)}"
    command = ["npm", "install", "--prefix", "{prefix}", "--no-audit", "--no-fund", "--omit=dev", spec]
    return _install("npm", spec, command, root, timeout_s)


def npm_bin(package: str, version: str, binary: str, *, root: Path | None = None) -> Path:
    path = npm_prefix(package, version, root=root) / "node_modules" / ".bin" / binary
    if not path.exists():
        raise InstallError(f"{package}@{version_of(package, version)} installed no binary named {binary!r}")
    return path


def pip_prefix(package: str, version: str, *, root: Path | None = None, timeout_s: float = 900) -> Path:
    """A `--target` folder holding `package==version` and its dependencies (put it on PYTHONPATH)."""
    spec = f"{package}=={version_of(package, version)}"
    command = [sys.executable, "-m", "pip", "install", "-q", "--target", "{prefix}", spec]
    return _install("pip", spec, command, root, timeout_s)


async def npm_bin_async(package: str, version: str, binary: str, *, root: Path | None = None) -> Path:
    """`npm_bin` off the event loop (a first install takes seconds)."""
    return await asyncio.to_thread(npm_bin, package, version, binary, root=root)
