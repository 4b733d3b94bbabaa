"""`polar images`: container images built on this machine, for clusters that reach no registry."""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from polar.runtime.base import RuntimeFailure
from polar.runtime.images import (
    DEFAULT_INCLUDE,
    DEFAULT_SUITE,
    DEFAULT_TAG,
    ENGINES,
    BaseImage,
    default_cache,
)


def _default_engine() -> str:
    return next((e for e in ENGINES if shutil.which(e)), "docker")


@click.group()
def images() -> None:
    """Build container images locally (no registry needed).

    \b
    Examples:
      polar images base                      # polar-base:bookworm in docker (or podman)
      polar images base --engine podman --include nodejs,npm
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
