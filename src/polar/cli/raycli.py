"""`--ray [ADDRESS]` and what each gateway node takes on its Ray node: the options `polar run` and
`polar serve` share (the code is `polar.rollout.ray`; docs/deploy.md)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import click

from polar.cli.common import F

# auto, local, HOST:PORT (a name, IPv4 or [IPv6]), ray://HOST:PORT (Ray Client)
_ADDRESS = re.compile(r"^(auto|local|ray://\S+|(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):\d+)$")


def _address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None or value == "":
        return value  # absent, or `--ray` alone
    if not _ADDRESS.match(value):
        raise click.BadParameter(
            f"{value!r} is not a Ray address (auto, HOST:PORT or ray://HOST:PORT); a file after --ray is "
            "taken as its ADDRESS: put it before --ray, or write --ray=ADDRESS"
        )
    return value


@dataclass(frozen=True)
class RayOptions:
    """--ray and its companions as given (`polar run` turns them into a `RayPlacement` for its tasks)."""

    address: str  # "" for --ray alone: RAY_ADDRESS, the last local cluster, or a new one
    resource: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    log_level: str = "warning"


def ray_options(run: bool) -> Callable[[F], F]:
    """`--ray`, `--ray-resource`, `--ray-cpus`, `--ray-memory` (`run`: their defaults come from the task
    file)."""
    cpus_default = "capacity x the largest runtime.cpus of the task file, at least 1" if run else "1"
    memory_default = "capacity x the largest runtime.memory_mb of the task file" if run else "none"

    def decorate(fn: F) -> F:
        options = [
            click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None,
                         metavar="[ADDRESS]", callback=_address,
                         help="Run the gateway nodes as Ray actors, one on each Ray node that offers what a node "
                         "takes (docs/deploy.md). ADDRESS: the Ray cluster (HOST:PORT, auto); alone: "
                         "RAY_ADDRESS, else the cluster last started on this machine, else a new local one. "
                         "Needs pip install 'polar-rl[ray]'."),
            click.option("--ray-resource", metavar="NAME",
                         help="Only Ray nodes declaring this custom resource get a gateway node (it takes one "
                         "unit), e.g. ray start --resources '{\"polar\": 1}'."),
            click.option("--ray-cpus", type=click.FloatRange(min=0),
                         help=f"CPUs each gateway node reserves on its Ray node (default: {cpus_default})."),
            click.option("--ray-memory", "ray_memory_mb", type=click.IntRange(min=0), metavar="MIB",
                         help=f"Memory each gateway node reserves, MiB (default: {memory_default})."),
        ]  # fmt: skip
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def check_ray_options(
    address: str | None, resource: str | None, cpus: float | None, memory: int | None
) -> None:
    """Before anything starts: the `ray` extra is there when --ray is given (one line naming it
    otherwise), and no --ray-* option is given without --ray."""
    if address is None:
        for name, value in (("--ray-resource", resource), ("--ray-cpus", cpus), ("--ray-memory", memory)):
            if value is not None:
                raise click.BadParameter("needs --ray", param_hint=name)
        return
    from polar.extras import RAY, require_cli

    require_cli(RAY)
