"""Harness presets: how to configure and run an agent program against the gateway, unmodified."""

from polar.harness.base import Harness, HarnessContext, gateway_env
from polar.harness.builtin import BuiltinHarness
from polar.harness.registry import get_harness, harness_names
from polar.harness.shell import ShellHarness

__all__ = [
    "BuiltinHarness",
    "Harness",
    "HarnessContext",
    "ShellHarness",
    "gateway_env",
    "get_harness",
    "harness_names",
]
