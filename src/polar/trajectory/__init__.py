"""Trajectories for RL, rebuilt token-faithfully from the gateway's completion records.

    build(records, strategy="prefix_merging", **options) -> Trajectory
    audit(trajectory, records) -> AuditReport
    register_builder(name, builder_or_import_path)

Strategies: `per_request` (one trace per call) and `prefix_merging` (one trace per chain of calls that
extend one another; see `polar.trajectory.chains`), or any builder by import path "pkg.mod:func".
"""

from polar.trajectory.audit import AuditReport, DriftTurn, audit
from polar.trajectory.errors import BuildError
from polar.trajectory.models import Trace, Trajectory, TrajectoryStatus
from polar.trajectory.registry import Builder, build, builders, get_builder, register_builder

__all__ = [
    "AuditReport",
    "BuildError",
    "Builder",
    "DriftTurn",
    "Trace",
    "Trajectory",
    "TrajectoryStatus",
    "audit",
    "build",
    "builders",
    "get_builder",
    "register_builder",
]
