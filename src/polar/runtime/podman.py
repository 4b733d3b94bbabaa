"""Podman: the docker runtime's code with podman's own command lines (`polar.runtime.docker`)."""

from polar.runtime.base import RuntimeEntry
from polar.runtime.docker import PodmanRuntime, check_engine

RUNTIME = RuntimeEntry(PodmanRuntime, check_engine, image=True, limits=True)
