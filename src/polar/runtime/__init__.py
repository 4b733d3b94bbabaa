"""Isolated places where a session's harness runs: local process groups, bubblewrap, docker, apptainer."""

from polar.runtime.base import ExecResult, Runtime, RuntimeFailure, RuntimeSpec

__all__ = ["ExecResult", "Runtime", "RuntimeFailure", "RuntimeSpec"]
