"""Isolated places where a session's harness runs: local process groups, bubblewrap, docker, apptainer."""

from polar.runtime.apptainer import ApptainerRuntime
from polar.runtime.base import ExecResult, Runtime, RuntimeFailure, RuntimeSpec
from polar.runtime.bwrap import BwrapRuntime
from polar.runtime.docker import DockerRuntime
from polar.runtime.factory import BACKENDS, check_runtime, make_runtime
from polar.runtime.local import Keep, LocalRuntime

__all__ = [
    "BACKENDS",
    "ApptainerRuntime",
    "BwrapRuntime",
    "DockerRuntime",
    "ExecResult",
    "Keep",
    "LocalRuntime",
    "Runtime",
    "RuntimeFailure",
    "RuntimeSpec",
    "check_runtime",
    "make_runtime",
]
