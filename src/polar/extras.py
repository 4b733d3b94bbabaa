"""Optional dependencies: which extra brings each optional feature, checked before the feature starts.

A command that will need an optional package says so in one line before it starts anything (a server, a
model, a session), instead of dying on an `ImportError` minutes later:

    polar generate tasks.yaml --format parquet      (pyarrow missing)
    Error: Parquet output needs pyarrow, which cannot be imported (No module named 'pyarrow'):
    pip install 'polar-rl[export]'

The check imports the modules for real (a broken install is as missing as an absent one); each is one the
feature imports right after anyway, so the check costs nothing extra when it passes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import click


@dataclass(frozen=True, slots=True)
class Extra:
    """An optional feature, the modules it imports, and the extra of `polar` that installs them."""

    feature: str
    modules: tuple[str, ...]
    extra: str


# pyarrow is a base dependency (Parquet is the exporters' default format); `export` stays as its alias.
PARQUET = Extra("Parquet output", ("pyarrow", "pyarrow.parquet"), "export")
ENGINE = Extra("the embedded engine", ("torch", "transformers"), "engine")
TRAINER = Extra("polar train", ("torch", "transformers"), "engine")
TENSORBOARD = Extra("metrics.tensorboard: true", ("tensorboard",), "tensorboard")
WANDB = Extra("metrics.wandb: true", ("wandb",), "wandb")
TRL = Extra("the TRL bridge (polar.train.bridges.trl)", ("trl",), "trl")
RAY = Extra("--ray (gateway nodes as Ray actors)", ("ray",), "ray")


class MissingExtra(RuntimeError):
    """An optional feature was asked for but a package it needs cannot be imported."""


def missing(extra: Extra) -> str | None:
    """Why `extra`'s feature cannot run here (one line naming the extra to install), or None."""
    for module in extra.modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return (
                f"{extra.feature} needs {module.split('.')[0]}, which cannot be imported ({exc}): "
                f"pip install 'polar-rl[{extra.extra}]'"
            )
    return None


def require(*extras: Extra) -> None:
    """Raise `MissingExtra` naming the first feature whose packages cannot be imported."""
    for extra in extras:
        why = missing(extra)
        if why is not None:
            raise MissingExtra(why)


class MissingExtraError(click.ClickException):
    """A CLI usage error: one line on stderr, exit status 2, before anything starts."""

    exit_code = 2


def require_cli(*extras: Extra) -> None:
    """`require` for a CLI command: a missing extra is a usage error (exit 2, no traceback)."""
    try:
        require(*extras)
    except MissingExtra as exc:
        raise MissingExtraError(str(exc)) from None
