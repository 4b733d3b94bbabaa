"""The one error type trajectory building raises for bad input, naming the offending parameter so the
gateway can answer a 4xx that points at it."""

from __future__ import annotations


class BuildError(ValueError):
    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
