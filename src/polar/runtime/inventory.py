"""What images a container engine holds, in one spelling, and pulling one.

Placement compares a task's `runtime.image` with what each node's engines hold, so both must be spelled
alike. Engines list images with their registry spelled out where a task usually leaves it implicit: docker
lists Docker Hub's official images bare (`python:3.11`) but keeps other registries (`ghcr.io/x/y:1`);
podman lists every image fully qualified (`docker.io/library/python:3.11`, and images built or imported
locally as `localhost/name:tag`). `normalize_ref` maps all of these, and a name without a tag (`:latest`
implied), to one key.
"""

from __future__ import annotations

from polar.runtime.base import RuntimeFailure
from polar.runtime.images import run_checked

LIST_TIMEOUT_S = 60.0
_IMPLICIT = ("docker.io/library/", "docker.io/", "index.docker.io/library/", "index.docker.io/", "localhost/")


def image_name_problem(ref: str) -> str | None:
    """Why `ref` cannot be an image name, or None. The engines take the image as an argument after their
    options (`docker run [OPTIONS] IMAGE`, `docker pull IMAGE`): a name starting with "-" would be read as
    an option (`--privileged`)."""
    if not ref or ref.startswith("-") or any(c.isspace() for c in ref):
        return "must be an image name: not empty, no whitespace, not starting with '-'"
    return None


def normalize_ref(ref: str) -> str:
    """One spelling of an image reference: no default registry or `localhost/` prefix, `:latest` where no
    tag (or digest) is named. `docker.io/library/python` and `python:latest` are the same key."""
    ref = ref.strip()
    for prefix in _IMPLICIT:
        if ref.startswith(prefix):
            ref = ref[len(prefix) :]
            break
    if "@" in ref:
        return ref
    last = ref.rsplit("/", 1)[-1]
    return ref if ":" in last else f"{ref}:latest"


def list_images(engine: str) -> frozenset[str]:
    """The normalized references of every tagged image `engine` holds (untagged layers are not named by any
    task). Raises RuntimeFailure when the engine is missing or does not answer."""
    argv = [engine, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"]
    done = run_checked(argv, f"`{engine} image ls`", LIST_TIMEOUT_S)
    refs = set()
    for line in done.stdout.splitlines():
        line = line.strip()
        if line and "<none>" not in line:
            refs.add(normalize_ref(line))
    return frozenset(refs)


def pull_image(engine: str, ref: str, timeout_s: float = 3600.0) -> None:
    """`ENGINE pull REF`, or RuntimeFailure with the tail of its output (no registry, no such image)."""
    problem = image_name_problem(ref)
    if problem is not None:
        raise RuntimeFailure(f"not an image reference: {ref!r} ({problem})")
    run_checked([engine, "pull", ref], f"`{engine} pull {ref}`", timeout_s)
