"""Container images built here, for machines that reach no registry (air-gapped clusters, CI).

`docker run IMAGE` with an image that is not local makes the engine ask a registry; where none answers, every
task image has to start from a base made locally. `mmdebstrap` builds a minimal Debian root file system from
the Debian package mirror the machine already uses (~30 s, ~270 MB), and `docker import` / `podman import`
turn the archive into an image. The archive is cached (named by what it holds), so another engine or a
rebuilt image costs an import, not a bootstrap.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from polar.runtime.base import RuntimeFailure

# What SWE-style tasks and harness presets need in a bare image: a shell with the usual tools, git and
# patch for diffs, Python for test suites, and certificates for any HTTPS a task may be allowed.
DEFAULT_INCLUDE = ("bash", "ca-certificates", "git", "patch", "procps", "python3")
DEFAULT_SUITE = "bookworm"
DEFAULT_TAG = "polar-base:bookworm"
ENGINES = ("docker", "podman")


def default_cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "polar" / "images"


@dataclass(frozen=True)
class BaseImage:
    """A minimal Debian image: `suite` with `include` on top of mmdebstrap's minbase variant."""

    tag: str = DEFAULT_TAG
    suite: str = DEFAULT_SUITE
    include: tuple[str, ...] = DEFAULT_INCLUDE

    def rootfs_name(self) -> str:
        key = "\n".join([self.suite, "minbase", *sorted(set(self.include))])
        return f"rootfs-{self.suite}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.tar"


def _run(argv: Sequence[str], what: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise RuntimeFailure(f"{what} needs `{argv[0]}`, which is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise RuntimeFailure(f"{what} did not finish within {timeout_s:g} s") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-1500:]
        raise RuntimeFailure(f"{what} failed (exit {done.returncode}): {tail}")
    return done


def build_rootfs(image: BaseImage, cache: Path, *, force: bool = False) -> tuple[Path, bool]:
    """The image's root file system archive in `cache`: (path, whether it was built now)."""
    target = cache / image.rootfs_name()
    if target.is_file() and not force:
        return target, False
    if shutil.which("mmdebstrap") is None:
        raise RuntimeFailure(
            "building a base image needs mmdebstrap (Debian/Ubuntu: apt-get install mmdebstrap)"
        )
    cache.mkdir(parents=True, exist_ok=True)
    # Built next to the target and renamed into place: an interrupted build leaves no half archive.
    fd, partial = tempfile.mkstemp(prefix=".rootfs-", suffix=".tar", dir=cache)
    os.close(fd)
    try:
        argv = [
            "mmdebstrap",
            "--variant=minbase",
            f"--include={','.join(image.include)}",
            image.suite,
            partial,
        ]
        _run(argv, "mmdebstrap", timeout_s=1800)
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target, True


def image_exists(engine: str, tag: str) -> bool:
    try:
        done = subprocess.run(
            [engine, "image", "inspect", tag], capture_output=True, text=True, timeout=60, check=False
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def import_image(engine: str, rootfs: Path, tag: str) -> None:
    _run([engine, "import", str(rootfs), tag], f"{engine} import", timeout_s=600)


def ensure_base_image(
    engine: str,
    image: BaseImage | None = None,
    *,
    cache: Path | None = None,
    force: bool = False,
    say: Callable[[str], None] = lambda _: None,
) -> str:
    """`image` (default: polar's base) in `engine`'s local store, built if missing; returns its tag."""
    image = image or BaseImage()
    if engine not in ENGINES:
        raise RuntimeFailure(f"unknown container engine {engine!r}; known: {', '.join(ENGINES)}")
    if not force and image_exists(engine, image.tag):
        say(f"{engine} already has {image.tag}")
        return image.tag
    cache = cache or default_cache()
    say(f"building the root file system ({image.suite}, {', '.join(image.include)}): about 30 s")
    rootfs, built = build_rootfs(image, cache, force=force)
    say(f"{'built' if built else 'reusing'} {rootfs} ({rootfs.stat().st_size / 1e6:.0f} MB)")
    import_image(engine, rootfs, image.tag)
    say(f"imported into {engine} as {image.tag}")
    return image.tag
