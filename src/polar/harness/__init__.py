"""Harness presets: how to configure and run an agent program against the gateway, unmodified."""

from polar.harness.base import Harness, HarnessContext, gateway_env

__all__ = ["Harness", "HarnessContext", "gateway_env"]
