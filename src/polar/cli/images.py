"""`polar images`: container images built on this machine, for clusters that reach no registry."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from polar.cli import FAILURES
from polar.runtime.base import RuntimeFailure
from polar.runtime.images import (
    DEFAULT_INCLUDE,
    DEFAULT_SUITE,
    DEFAULT_TAG,
    ENGINES,
    BaseImage,
    default_cache,
)

if TYPE_CHECKING:
    from polar.task import ImageBuild, Task


def _default_engine() -> str:
    return next((e for e in ENGINES if shutil.which(e)), "docker")


@click.group()
def images() -> None:
    """Build container images locally (no registry needed).

    \b
    Examples:
      polar images base                      # polar-base:bookworm in docker (or podman)
      polar images base --engine podman --include nodejs,npm
      polar images build examples/swe/swe.yaml   # the images a task file's tasks run in
    """


@images.command()
@click.option(
    "--engine", type=click.Choice(ENGINES), default=None, help="Default: docker if installed, else podman."
)
@click.option("--tag", default=DEFAULT_TAG, show_default=True, help="Name of the image to create.")
@click.option("--suite", default=DEFAULT_SUITE, show_default=True, help="Debian release to bootstrap.")
@click.option(
    "--include",
    default=",".join(DEFAULT_INCLUDE),
    show_default=True,
    help="Debian packages installed on top of the minimal base, comma-separated.",
)
@click.option(
    "--cache",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where root file system archives are kept. Default: ~/.cache/polar/images.",
)
@click.option("--force", is_flag=True, help="Bootstrap and import again even if the image exists.")
def base(engine: str | None, tag: str, suite: str, include: str, cache: Path | None, force: bool) -> None:
    """Build a minimal Debian base image with mmdebstrap and import it into ENGINE.

    Uses the Debian mirror this machine's apt already uses: no registry is contacted. Task images
    (`FROM polar-base:bookworm`) then build offline with `docker build` / `podman build --pull=never`.

    \b
    Examples:
      polar images base
      polar images base --engine podman --tag my-base:1 --include python3,git,nodejs,npm
    """
    from polar.runtime.images import ensure_base_image

    engine = engine or _default_engine()
    packages = tuple(p.strip() for p in include.split(",") if p.strip())
    if not packages:
        raise click.BadParameter("name at least one package", param_hint="--include")
    image = BaseImage(tag=tag, suite=suite, include=packages)
    try:
        ensure_base_image(engine, image, cache=cache or default_cache(), force=force, say=click.echo)
    except RuntimeFailure as exc:
        raise click.ClickException(str(exc)) from None


@dataclass
class _Image:
    """One image a task file needs in one engine, and the tasks that run in it."""

    engine: str
    tag: str
    build: ImageBuild | None
    tasks: list[str] = field(default_factory=list)


def _collect(tasks: list[Task], engine: str | None) -> tuple[list[_Image], list[str]]:
    """The distinct images of the tasks that run in a container (same engine and tag: one image), and the
    ids of the tasks that run in none. The same tag built two ways is an error naming both tasks."""
    images: dict[tuple[str, str], _Image] = {}
    skipped = []
    for task in tasks:
        rt = task.runtime
        if rt.backend not in ENGINES or rt.image is None:
            skipped.append(task.task_id)
            continue
        key = (engine or rt.backend, rt.image)
        image = images.setdefault(key, _Image(key[0], rt.image, rt.build))
        if rt.build is not None and image.build is not None and rt.build != image.build:
            first = next(t for t in tasks if t.task_id in image.tasks and t.runtime.build == image.build)
            raise click.ClickException(
                f"{rt.image} is built two ways: task {first.task_id} from "
                f"{_where(image.build)}, task {task.task_id} from {_where(rt.build)}"
            )
        image.build = image.build or rt.build
        image.tasks.append(task.task_id)
    return _in_build_order(list(images.values())), skipped


def make(wanted: list[_Image], *, force: bool = False, pull: bool = False) -> dict[str, int]:
    """Build each image that has a `runtime.build` (unless up to date), or with `pull` pull each one the
    engine lacks instead; say one line per image and a summary. Returns the count per outcome."""
    from polar.runtime.images import build_image, image_exists
    from polar.runtime.inventory import pull_image

    counts = dict.fromkeys(("built", "up to date", "present", "pulled", "missing", "failed"), 0)
    for n, image in enumerate(wanted, 1):
        head = f"[{n}/{len(wanted)}] {image.tag} ({image.engine}"
        head += f", {len(image.tasks)} tasks)" if len(image.tasks) > 1 else f", task {image.tasks[0]})"
        if pull or image.build is None:
            if image_exists(image.engine, image.tag):
                counts["present"] += 1
                click.echo(f"{head}: present")
            elif pull:
                started = time.monotonic()
                click.echo(f"{head}: pulling ...")
                try:
                    pull_image(image.engine, image.tag)
                except RuntimeFailure as exc:
                    counts["failed"] += 1
                    click.echo(f"{head}: failed: {exc}")
                else:
                    counts["pulled"] += 1
                    click.echo(f"{head}: pulled in {time.monotonic() - started:.1f} s")
            else:
                counts["missing"] += 1
                click.echo(
                    f"{head}: missing (no runtime.build, and {image.engine} has no such image: give its tasks a "
                    f"runtime.build, build it yourself, or `{image.engine} pull {image.tag}` where a registry "
                    "is reachable)"
                )
            continue
        assert image.build is not None
        started = time.monotonic()

        def progress(line: str, head: str = head) -> None:
            click.echo(f"{head}: {line} ...")

        try:
            result = build_image(
                image.engine,
                image.tag,
                Path(image.build.context),
                image.build.dockerfile,
                force=force,
                say=progress,
            )
        except RuntimeFailure as exc:
            counts["failed"] += 1
            click.echo(f"{head}: failed: {exc}")
            continue
        state = "built" if result.built else "up to date"
        counts[state] += 1
        took = f" in {time.monotonic() - started:.1f} s" if result.built else ""
        click.echo(f"{head}: {state}{took} ({result.image_id.removeprefix('sha256:')[:12]})")
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    click.echo(f"{len(wanted)} image(s): {summary or 'nothing to do'}")
    return counts


def collect(tasks: list[Task]) -> list[_Image]:
    """The distinct container images of `tasks`, in build order (`polar run --images`)."""
    return _collect(tasks, None)[0]


def _where(build: ImageBuild) -> str:
    return str(Path(build.context) / build.dockerfile)


def _in_build_order(images: list[_Image]) -> list[_Image]:
    """Images whose Dockerfile starts FROM another image of the list come after it."""
    from polar.runtime.images import dockerfile_bases

    def bases(image: _Image) -> set[tuple[str, str]]:
        if image.build is None:
            return set()
        try:
            text = (Path(image.build.context) / image.build.dockerfile).read_text(errors="replace")
        except OSError:
            return set()  # the build reports it
        return {(image.engine, b) for b in dockerfile_bases(text)}

    needs = {(i.engine, i.tag): bases(i) for i in images}
    ordered: list[_Image] = []
    done: set[tuple[str, str]] = set()
    while len(ordered) < len(images):
        pending = [i for i in images if (i.engine, i.tag) not in done]
        ready = [i for i in pending if not (needs[(i.engine, i.tag)] & {(p.engine, p.tag) for p in pending})]
        for image in ready or pending:  # a cycle: build in file order, the missing base is reported
            ordered.append(image)
            done.add((image.engine, image.tag))
    return ordered


@images.command()
@click.argument("taskfile", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--engine",
    type=click.Choice(ENGINES),
    default=None,
    help="Build every image in this engine. Default: each task's runtime.backend.",
)
@click.option("--force", is_flag=True, help="Build again (without the layer cache) even if up to date.")
@click.option(
    "--only", "only", multiple=True, metavar="TASK_ID", help="Only the images of these tasks (repeatable)."
)
def build(taskfile: Path, engine: str | None, force: bool, only: tuple[str, ...]) -> None:
    """Build the container images TASKFILE's tasks run in, from their `runtime.build` Dockerfiles.

    Each distinct image (engine and tag) is built once, with the engine's own builder (`docker build`,
    `podman build --pull=never`), and labelled with a hash of its Dockerfile, context and base images:
    an unchanged image is not built again. Base images must be local (nothing is pulled): make them
    with `polar images base`. An image with no `runtime.build` must already be present. Exits 3
    when an image failed to build or is missing.

    \b
    Examples:
      polar images build examples/swe/swe.yaml
      polar images build tasks.yaml --engine podman --only task-3 --only task-7
      polar images build tasks.yaml --force     # rebuild everything from scratch
    """
    from polar.rollout.taskfile import TaskFileError, load_tasks

    try:
        tasks = load_tasks(taskfile, resolve_imports=False)  # images only: no task code is imported
    except TaskFileError as exc:
        raise click.ClickException(str(exc)) from None
    if only:
        known = {t.task_id for t in tasks}
        unknown = [i for i in only if i not in known]
        if unknown:
            raise click.BadParameter(f"no task {', '.join(unknown)} in {taskfile}", param_hint="--only")
        tasks = [t for t in tasks if t.task_id in set(only)]
    wanted, skipped = _collect(tasks, engine)
    if skipped:
        click.echo(f"{len(skipped)} task(s) run in no docker/podman image (runtime.backend): skipped")
    counts = make(wanted, force=force)
    if counts["missing"] or counts["failed"]:
        raise click.exceptions.Exit(FAILURES)
