"""Task sources beside hand-written `tasks:`: SWE-bench-format datasets.

A task file may hold

    dataset:
      format: swebench          # SWE-bench, SWE-Gym, SWE-smith, R2E-Gym style instances
      path: instances.jsonl     # .jsonl / .json / .parquet next to the file, or a Hugging Face dataset name
      split: test               # hub datasets only
      ids: [astropy__astropy-12907]
      task_repo: ../swe-bench-tasks  # optional: a SWE-bench 5.x task repo holding the images' Dockerfiles
    defaults:                   # merged over every generated task (any task field)
      runtime: {backend: docker}
      agent: {harness: codex}

Each instance becomes a task: `task_id` is its `instance_id`, the instruction its `problem_statement`, the
runtime image its `image` (or SWE-bench's naming convention for Docker Hub images), the workdir `/testbed`
(where SWE-bench images hold the repository at `base_commit`), and the `swebench` evaluator with the
instance's grading fields (`polar.evaluate.swebench`). `defaults` win over what an instance gives.

Where no registry holds the images, `polar images build` builds them from Dockerfiles: an instance's own
`build: {context, dockerfile}` (as `runtime.build`, the context relative to the dataset file), or else the
`task_repo`'s `tasks/<instance_id>/Dockerfile`, built in its directory as `swebench images build` does.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# What the `swebench` evaluator needs of an instance (the rest of a dataset row stays out of the task).
GRADING_FIELDS = (
    "instance_id",
    "repo",
    "version",
    "base_commit",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "log_parser",
    "eval_type",
    "eval_script",
    "image",
)


class DatasetError(ValueError):
    """A dataset that cannot be loaded or turned into tasks; the message says which instance and why."""


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["swebench", "harbor"] = Field(
        description="swebench: SWE-bench-format instances; harbor: Harbor task directories "
        "(polar.rollout.harbor)."
    )
    path: str = Field(
        min_length=1,
        description="swebench: a .jsonl, .json or .parquet file relative to the task file, or a Hugging "
        "Face dataset; harbor: a folder of task directories (or one task directory).",
    )
    split: str = Field("test", description="The split of a Hugging Face dataset.")
    ids: list[str] | None = Field(None, description="Only these instance ids, in the dataset's order.")
    task_repo: str | None = Field(
        None,
        min_length=1,
        description="A SWE-bench 5.x task repo (relative to the task file): an instance with no `build` of its "
        "own gets runtime.build from tasks/<instance_id>/Dockerfile there (`polar images build`).",
    )


def swebench_image(instance_id: str) -> str:
    """SWE-bench's name for an instance's evaluation image on Docker Hub (x86_64)."""
    return f"swebench/sweb.eval.x86_64.{instance_id.lower().replace('__', '_1776_')}:latest"


def read_instances(spec: DatasetSpec, base: Path) -> list[dict[str, Any]]:
    """The dataset's rows (dicts), from a file next to the task file or from the Hugging Face hub."""
    local = base / spec.path
    suffix = Path(spec.path).suffix
    if suffix in (".jsonl", ".json", ".parquet") or local.exists():
        if not local.is_file():
            raise DatasetError(f"dataset.path: {local} does not exist")
        try:
            if suffix == ".parquet":
                import pyarrow.parquet as pq

                rows: list[dict[str, Any]] = pq.read_table(local).to_pylist()
            elif suffix == ".json":
                data = json.loads(local.read_text())
                rows = data if isinstance(data, list) else [data]
            else:
                rows = [json.loads(line) for line in local.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as exc:
            raise DatasetError(f"dataset.path: cannot read {local}: {exc}") from None
    else:
        try:
            import datasets
        except ImportError:
            raise DatasetError(
                f"dataset.path: {spec.path!r} is not a file here, and reading a Hugging Face dataset needs the "
                "`datasets` package (pip install datasets)"
            ) from None
        try:
            rows = [dict(r) for r in datasets.load_dataset(spec.path, split=spec.split)]
        except Exception as exc:
            raise DatasetError(f"dataset.path: cannot load {spec.path!r} ({spec.split}): {exc}") from None
    if not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"dataset.path: {spec.path} holds rows that are not objects")
    return rows


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def instance_build(row: dict[str, Any], spec: DatasetSpec, base: Path) -> dict[str, Any] | None:
    """The runtime.build of an instance's image: its own `build` (context relative to the dataset file), or
    the task repo's Dockerfile for it, or None."""
    build = row.get("build")
    if isinstance(build, dict):
        root = (base / spec.path).parent if (base / spec.path).is_file() else base
        if isinstance(build.get("context"), str):
            return {**build, "context": str(root / build["context"])}
        return build  # validated (and reported at its field) with the task
    if build is not None:
        raise DatasetError(f"dataset: {row['instance_id']}: build must be {{context, dockerfile}}")
    if spec.task_repo is None:
        return None
    folder = base / spec.task_repo / "tasks" / row["instance_id"]
    if not (folder / "Dockerfile").is_file():
        raise DatasetError(f"dataset.task_repo: no {folder / 'Dockerfile'}")
    return {"context": str(folder), "dockerfile": "Dockerfile"}


def swebench_tasks(
    rows: Iterable[dict[str, Any]], spec: DatasetSpec, defaults: dict[str, Any], base: Path | None = None
) -> list[dict[str, Any]]:
    """One task (as a dict, validated by the caller) per instance; relative paths are taken from `base`
    (the task file's directory)."""
    base = base or Path.cwd()
    rows = list(rows)
    if spec.ids is not None:
        known = {r.get("instance_id") for r in rows}
        missing = [i for i in spec.ids if i not in known]
        if missing:
            raise DatasetError(f"dataset.ids: not in {spec.path}: {', '.join(missing)}")
        wanted = set(spec.ids)
        rows = [r for r in rows if r.get("instance_id") in wanted]
    tasks = []
    for n, row in enumerate(rows):
        iid = row.get("instance_id")
        if not isinstance(iid, str) or not iid:
            raise DatasetError(f"dataset: instance {n} has no instance_id")
        statement = row.get("problem_statement")
        if not isinstance(statement, str) or not statement.strip():
            raise DatasetError(f"dataset: {iid}: no problem_statement")
        image = row.get("image") or swebench_image(iid)
        instance = {k: row[k] for k in GRADING_FIELDS if k in row} | {"image": image}
        runtime: dict[str, Any] = {"image": image, "workdir": "/testbed"}
        build = instance_build(row, spec, base)
        if build is not None:
            runtime["build"] = build
        task = {
            "task_id": iid,
            "instruction": statement,
            "runtime": runtime,
            "evaluator": {"strategy": "swebench", "config": {"instance": instance}},
            "metadata": {"dataset": spec.path, "repo": row.get("repo"), "instance_id": iid},
        }
        tasks.append(_merge(task, defaults))
    if not tasks:
        raise DatasetError(f"dataset: no instances in {spec.path}")
    return tasks
