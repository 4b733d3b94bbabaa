"""Task sources beside hand-written `tasks:`: published SWE datasets.

A task file may hold

    dataset:
      format: swebench          # swebench (SWE-bench), swegym, swesmith, r2egym: rows as published
      path: instances.jsonl     # .jsonl / .json / .parquet or a `datasets` save_to_disk folder next to the
                                # file, or a Hugging Face dataset name
      split: test               # hub datasets and DatasetDict folders
      ids: [astropy__astropy-12907]
      specs: {}                 # test specs for repos the publishing harness does not know
      task_repo: ../swe-bench-tasks  # optional: a SWE-bench 5.x task repo holding the images' Dockerfiles
    defaults:                   # merged over every generated task (any task field)
      runtime: {backend: docker}
      agent: {harness: codex}

Each row becomes a task: `task_id` is its `instance_id` (R2E-Gym: `<repo_name>__<commit_hash>`), the
instruction its `problem_statement`, the runtime image the one its publisher names, the workdir `/testbed`,
and the `swebench` evaluator with the row's grading as `polar.rollout.published` derives it. `defaults` win
over what a row gives.

Where no registry holds the images, `polar images build` builds them from Dockerfiles: a row's own
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

from polar.rollout import published
from polar.rollout.published import Row, ShapeError, swebench_image

__all__ = ["DatasetError", "DatasetSpec", "read_rows", "swebench_image", "swebench_tasks"]


class DatasetError(ValueError):
    """A dataset that cannot be loaded or turned into tasks; the message says which instance and why."""


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["swebench", "swegym", "swesmith", "r2egym", "harbor"] = Field(
        description="swebench: SWE-bench rows (Verified, Lite, full; classic or swebench 5.x columns); "
        "swegym: SWE-Gym rows; swesmith: SWE-smith rows; r2egym: R2E-Gym rows; harbor: Harbor task "
        "directories (polar.rollout.harbor)."
    )
    path: str = Field(
        min_length=1,
        description="A .jsonl, .json or .parquet file or a `datasets` save_to_disk folder, relative to the "
        "task file, or a Hugging Face dataset; harbor: a folder of task directories (or one task directory).",
    )
    split: str = Field("test", description="The split of a Hugging Face dataset or a DatasetDict folder.")
    ids: list[str] | None = Field(None, description="Only these instance ids, in the dataset's order.")
    specs: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Test specs for repositories the publishing harness does not know, merged into its "
        "own. swebench, swegym: {repo: {version: spec}} in swebench's MAP_REPO_VERSION_TO_SPECS shape "
        "(test_cmd, install, eval_commands, ...) plus log_parser (a swebench parser name); swesmith: "
        "{repo: {test_cmd}} (a Python profile).",
    )
    task_repo: str | None = Field(
        None,
        min_length=1,
        description="A SWE-bench 5.x task repo (relative to the task file): an instance with no `build` of its "
        "own gets runtime.build from tasks/<instance_id>/Dockerfile there (`polar images build`).",
    )


def _from_disk(local: Path, spec: DatasetSpec) -> list[dict[str, Any]]:
    """The rows of a `datasets` save_to_disk folder (a Dataset, or a DatasetDict's `split`)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"dataset.path: {local} is a `datasets` folder; reading it needs the datasets package "
            "(pip install datasets)"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(local))
    except Exception as exc:
        raise DatasetError(f"dataset.path: cannot read {local} with datasets.load_from_disk: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if spec.split not in loaded:
            raise DatasetError(f"dataset.split: {local} has splits {', '.join(loaded)}, not {spec.split!r}")
        loaded = loaded[spec.split]
    return [dict(r) for r in loaded]


def read_rows(spec: DatasetSpec, base: Path) -> list[Row]:
    """The dataset's rows, each with where it is (`file:line`, or `file: row N`), from a file or a
    `datasets` folder next to the task file, or from the Hugging Face hub."""
    local = base / spec.path
    suffix = Path(spec.path).suffix
    if local.is_dir():
        return [(f"{local}: row {n}", r) for n, r in enumerate(_from_disk(local, spec))]
    if suffix in (".jsonl", ".json", ".parquet") or local.exists():
        if not local.is_file():
            raise DatasetError(f"dataset.path: {local} does not exist")
        try:
            if suffix == ".parquet":
                import pyarrow.parquet as pq

                rows = [(f"{local}: row {n}", r) for n, r in enumerate(pq.read_table(local).to_pylist())]
            elif suffix == ".json":
                data = json.loads(local.read_text())
                rows = [
                    (f"{local}: row {n}", r) for n, r in enumerate(data if isinstance(data, list) else [data])
                ]
            else:
                rows = [
                    (f"{local}:{n}", json.loads(line))
                    for n, line in enumerate(local.read_text().splitlines(), 1)
                    if line.strip()
                ]
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
            loaded = datasets.load_dataset(spec.path, split=spec.split)
        except Exception as exc:
            raise DatasetError(f"dataset.path: cannot load {spec.path!r} ({spec.split}): {exc}") from None
        rows = [(f"{spec.path} ({spec.split}): row {n}", dict(r)) for n, r in enumerate(loaded)]
    bad = next((w for w, r in rows if not isinstance(r, dict)), None)
    if bad is not None:
        raise DatasetError(f"dataset.path: {bad}: not an object")
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
        raise DatasetError(f"dataset: {row.get('instance_id')}: build must be {{context, dockerfile}}")
    if spec.task_repo is None:
        return None
    folder = base / spec.task_repo / "tasks" / str(row.get("instance_id"))
    if not (folder / "Dockerfile").is_file():
        raise DatasetError(f"dataset.task_repo: no {folder / 'Dockerfile'}")
    return {"context": str(folder), "dockerfile": "Dockerfile"}


def _task_id(spec: DatasetSpec, row: dict[str, Any]) -> Any:
    return published.r2e_task_id(row) if spec.format == "r2egym" else row.get("instance_id")


def swebench_tasks(
    rows: Iterable[Row], spec: DatasetSpec, defaults: dict[str, Any], base: Path | None = None
) -> list[dict[str, Any]]:
    """One task (as a dict, validated by the caller) per row; relative paths are taken from `base`
    (the task file's directory)."""
    base = base or Path.cwd()
    rows = list(rows)
    if spec.ids is not None:
        known = {_task_id(spec, r) for _, r in rows}
        missing = [i for i in spec.ids if i not in known]
        if missing:
            raise DatasetError(f"dataset.ids: not in {spec.path}: {', '.join(missing)}")
        wanted = set(spec.ids)
        rows = [(w, r) for w, r in rows if _task_id(spec, r) in wanted]
    for where, row in rows:
        iid = _task_id(spec, row)
        if spec.format != "r2egym" and (not isinstance(iid, str) or not iid):
            raise DatasetError(f"dataset: {where}: no instance_id")
        statement = row.get("problem_statement")
        if not isinstance(statement, str) or not statement.strip():
            raise DatasetError(f"dataset: {where}: {iid}: no problem_statement")
    try:
        graded = _graded(rows, spec)
    except ShapeError as exc:
        raise DatasetError(f"dataset: {exc}") from None
    tasks = []
    for (_, row), (inst, prepare) in zip(rows, graded, strict=True):
        iid = inst["instance_id"]
        statement = row["problem_statement"]
        runtime: dict[str, Any] = {"image": inst["image"], "workdir": "/testbed"}
        if prepare:
            runtime["prepare"] = [{"type": "exec", "cmd": cmd} for cmd in prepare]
        build = instance_build(row, spec, base)
        if build is not None:
            runtime["build"] = build
        task = {
            "task_id": iid,
            "instruction": published.r2egym_instruction(statement) if spec.format == "r2egym" else statement,
            "runtime": runtime,
            "evaluator": {"strategy": "swebench", "config": {"instance": inst}},
            "metadata": {
                "dataset": spec.path,
                "format": spec.format,
                "repo": inst["repo"],
                "instance_id": iid,
            },
        }
        tasks.append(_merge(task, defaults))
    if not tasks:
        raise DatasetError(f"dataset: no instances in {spec.path}")
    return tasks


def _graded(rows: list[Row], spec: DatasetSpec) -> list[tuple[dict[str, Any], list[str]]]:
    """Each row's evaluator instance and prepare commands, as its shape has them."""
    if spec.format in ("swebench", "swegym"):
        found = published.swebench_instances(rows, spec.specs, gym=spec.format == "swegym")
        return [(inst, []) for inst in found]
    if spec.format == "swesmith":
        return published.swesmith_instances(rows, spec.specs)
    return [(published.r2egym_instance(w, r), [published.R2E_SETUP]) for w, r in rows]
