"""Isolated places where a session's harness runs: local process groups, bubblewrap, docker, apptainer."""

from polar.runtime.base import ExecResult, Runtime, RuntimeFailure, RuntimeSpec
from polar.runtime.factory import check_runtime, make_runtime
from polar.runtime.local import LocalRuntime

__all__ = [
    "ExecResult",
    "LocalRuntime",
    "Runtime",
    "RuntimeFailure",
    "RuntimeSpec",
    "check_runtime",
    "make_runtime",
]
