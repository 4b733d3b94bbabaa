"""Test specs of published rows, built by the harness that publishes them, pinned.

swebench 5.x (the grader polar's `swebench` evaluator runs on the nodes) builds no test spec from a row as
SWE-bench, SWE-Gym and the other classic datasets publish it: its datasets carry their own `eval_script`,
and `MAP_REPO_VERSION_TO_SPECS` and `harness.test_spec` are gone (its changelog, 5.0.0). swebench 4.1.0 is
the last release that builds one (`swebench.harness.test_spec`); SWE-smith's profiles (swesmith 0.0.9)
import that API too. Both are installed once, without dependencies, into the tool cache
(`polar.harness.install`, from the package index) and run in a child process that imports them ahead of
the environment's swebench 5.x (`published_worker.py`); what they build is what the rows' tasks carry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from polar.harness.install import InstallError, pip_prefix

SWEBENCH_PIN = "4.1.0"
SWESMITH_PIN = "0.0.9"
WORKER = Path(__file__).with_name("published_worker.py")


class SpecError(RuntimeError):
    """The pinned harness could not be installed or run (the message says which and why)."""


def _prefixes(shape: str) -> list[Path]:
    try:
        found = [pip_prefix("swebench", SWEBENCH_PIN, deps=False)]
        if shape == "swesmith":
            found.insert(0, pip_prefix("swesmith", SWESMITH_PIN, deps=False))
    except InstallError as exc:
        raise SpecError(f"the pinned harness is not installed here and could not be: {exc}") from None
    return found


def build(shape: str, rows: list[dict[str, Any]], specs: dict[str, Any]) -> list[dict[str, Any]]:
    """One answer per row from the pinned harness (`published_worker`), in order."""
    if not rows:
        return []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in _prefixes(shape))
    request = {"shape": shape, "rows": rows, "specs": specs, "swebench_version": SWEBENCH_PIN}
    try:
        done = subprocess.run(
            [sys.executable, "-P", str(WORKER)],  # -P: not its own folder first (polar.rollout.datasets)
            input=json.dumps(request),
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        raise SpecError(f"swebench {SWEBENCH_PIN} took over 600 s to build {len(rows)} test specs") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip()[-1500:]
        raise SpecError(
            f"swebench {SWEBENCH_PIN} failed building test specs ({done.returncode}): {tail}; it needs the "
            "swebench package's dependencies here: pip install 'polar-rl[swe]'"
        )
    answers: list[dict[str, Any]] = json.loads(lines[-1])
    return answers
