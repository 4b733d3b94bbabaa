"""Container images built here, for machines that reach no registry (air-gapped clusters, CI).

`docker run IMAGE` with an image that is not local makes the engine ask a registry; where none answers, every
task image has to start from a base made locally. `mmdebstrap` builds a minimal Debian root file system from
the Debian package mirror the machine already uses (~30 s, ~270 MB), and `docker import` / `podman import`
turn the archive into an image. The archive is cached (named by what it holds), so another engine or a
rebuilt image costs an import, not a bootstrap.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
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


def run_checked(argv: Sequence[str], what: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`argv`'s result, or RuntimeFailure naming `what`: not installed, too slow, or failed (its output's tail)."""
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
        run_checked(argv, "mmdebstrap", timeout_s=1800)
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target, True


def image_exists(engine: str, tag: str) -> bool:
    return image_missing(engine, tag) is None


def image_missing(engine: str, tag: str) -> str | None:
    """None when `engine` has the image `tag`; otherwise why not, in a few words (for one line to a user)."""
    try:
        done = _image_inspect(engine, tag, "{{.Id}}")
    except FileNotFoundError:
        return f"{engine} is not installed"
    except subprocess.TimeoutExpired:
        return f"`{engine} image inspect` did not answer within 60 s"
    if done.returncode == 0:
        return None
    err = (done.stderr.strip().splitlines() or [""])[-1]
    low = err.lower()
    # docker: "Error response from daemon: No such image: x"; podman: "Error: x: image not known".
    if "no such image" in low or "image not known" in low:
        return "not on this machine"
    if "cannot connect" in low or "daemon running" in low:
        return f"{engine} is not running ({err})"
    return f"`{engine} image inspect` failed ({err or f'exit {done.returncode}'})"


def _image_inspect(engine: str, tag: str, fmt: str) -> subprocess.CompletedProcess[str]:
    """`ENGINE image inspect --format FMT TAG`, at most 60 s (its callers say what a failure means)."""
    return subprocess.run(
        [engine, "image", "inspect", "--format", fmt, tag],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def import_image(engine: str, rootfs: Path, tag: str) -> None:
    run_checked([engine, "import", str(rootfs), tag], f"{engine} import", timeout_s=600)


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


# -- task images from Dockerfiles -----------------------------------------------------------------------

# The label an image built here carries: a hash of everything its build read (the Dockerfile, the context's
# files, the ids of its local base images), so an unchanged image is not built again.
BUILD_LABEL = "polar.build.hash"


@dataclass(frozen=True)
class BuildResult:
    tag: str
    built: bool  # False: the image was up to date (same hash), nothing ran
    image_id: str


def dockerfile_bases(text: str) -> list[str]:
    """The images a Dockerfile's FROM lines name (not `scratch`, not an earlier stage, not `$ARG` names)."""
    bases: list[str] = []
    stages: set[str] = set()
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        words = line.split()
        if not words or words[0].upper() != "FROM":
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if not args:
            continue
        image = args[0]
        if image.lower() not in stages and image != "scratch" and "$" not in image and image not in bases:
            bases.append(image)
        if len(args) >= 3 and args[1].upper() == "AS":
            stages.add(args[2].lower())
    return bases


def _inspect(engine: str, tag: str) -> tuple[str, dict[str, str]] | None:
    """(id, labels) of a local image, or None when the engine's store has no such image."""
    try:
        done = _image_inspect(engine, tag, "{{.Id}} {{json .Config.Labels}}")
    except FileNotFoundError:
        raise RuntimeFailure(f"building images needs `{engine}`, which is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise RuntimeFailure(f"`{engine} image inspect {tag}` did not answer within 60 s") from None
    if done.returncode != 0:
        return None
    image_id, _, labels = done.stdout.strip().partition(" ")
    parsed = json.loads(labels or "null") or {}
    return image_id, {str(k): str(v) for k, v in parsed.items()}


def build_hash(context: Path, dockerfile: Path, base_ids: Sequence[str]) -> str:
    """What a build reads: the Dockerfile's bytes, the base images' ids and every entry of the context
    (relative name, mode, bytes; a symlink's target). `.dockerignore` is not interpreted: the files it leaves
    out are hashed too, so changing one rebuilds (a needless build, never a stale image)."""
    h = hashlib.sha256()
    for part in (dockerfile.read_bytes(), *(b.encode() for b in base_ids)):
        h.update(len(part).to_bytes(8, "big") + part)
    for root, dirs, files in os.walk(context):
        dirs.sort()
        for name in sorted([*dirs, *files]):
            path = Path(root) / name
            rel = path.relative_to(context).as_posix()
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                record = f"L\0{rel}\0{os.readlink(path)}\0".encode()
            elif stat.S_ISDIR(st.st_mode):
                record = f"D\0{rel}\0{stat.S_IMODE(st.st_mode):o}\0".encode()
            elif stat.S_ISREG(st.st_mode):
                record = f"F\0{rel}\0{stat.S_IMODE(st.st_mode):o}\0{st.st_size}\0".encode()
                h.update(record)
                try:
                    with path.open("rb") as f:
                        for chunk in iter(lambda: f.read(1 << 20), b""):
                            h.update(chunk)
                except OSError as exc:
                    raise RuntimeFailure(f"cannot read {path} in the build context: {exc.strerror}") from None
                continue
            else:
                continue  # sockets, fifos: a build does not send them
            h.update(record)
    return h.hexdigest()


def build_image(
    engine: str,
    tag: str,
    context: Path,
    dockerfile: str = "Dockerfile",
    *,
    force: bool = False,
    timeout_s: float = 3600,
    say: Callable[[str], None] = lambda _: None,
) -> BuildResult:
    """`tag` built from `context` with `engine`'s own builder (docker's legacy builder, `podman build`),
    unless the image already carries the hash of this Dockerfile, context and base images. Base images must
    be local: this never pulls (a missing base is an error saying how to make it). `force` builds again
    without the layer cache."""
    if engine not in ENGINES:
        raise RuntimeFailure(f"unknown container engine {engine!r}; known: {', '.join(ENGINES)}")
    if not context.is_dir():
        raise RuntimeFailure(f"cannot build {tag}: its build context {context} is not a directory")
    file = context / dockerfile
    if not file.is_file():
        raise RuntimeFailure(f"cannot build {tag}: there is no Dockerfile at {os.path.normpath(file)}")
    base_ids = []
    for base in dockerfile_bases(file.read_text(errors="replace")):
        found = _inspect(engine, base)
        if found is None:
            raise RuntimeFailure(
                f"cannot build {tag}: its base image {base} (FROM in {os.path.normpath(file)}) is not in "
                f"{engine}'s local images, and polar never pulls one. Make it first: `polar images base "
                f"--engine {engine} --tag {base} --include PACKAGES` (a Debian base from the apt mirror), or "
                f"`{engine} pull {base}` where a registry is reachable"
            )
        base_ids.append(found[0])
    digest = build_hash(context, file, base_ids)
    present = _inspect(engine, tag)
    if not force and present is not None and present[1].get(BUILD_LABEL) == digest:
        return BuildResult(tag, False, present[0])
    argv = [engine, "build", "--label", f"{BUILD_LABEL}={digest}", "-t", tag, "-f", str(file)]
    # podman never pulls with --pull=never; docker's legacy builder has no such flag (the bases were checked
    # above). --force-rm: a failed docker build leaves no stopped container behind.
    argv.insert(2, "--pull=never" if engine == "podman" else "--force-rm")
    if force:
        argv.insert(2, "--no-cache")
    say(f"building from {context}")
    try:
        done = subprocess.run(
            [*argv, str(context)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeFailure(f"building {tag} with {engine} did not finish within {timeout_s:g} s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-25:])
        raise RuntimeFailure(f"building {tag} with {engine} failed (exit {done.returncode}):\n{tail}")
    after = _inspect(engine, tag)
    if after is None:
        raise RuntimeFailure(f"{engine} build reported success but has no image {tag}")
    return BuildResult(tag, True, after[0])
