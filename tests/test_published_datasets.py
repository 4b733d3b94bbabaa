"""Published SWE rows (SWE-bench, SWE-Gym, SWE-smith, R2E-Gym) become tasks: their image, their grading,
and an error naming the row where the publishing harness cannot grade it. No containers: the graded runs
are tests/test_published_grading.py. The specs come from the pinned harness (swebench 4.1.0, swesmith
0.0.9), installed into the tool cache on first use from the package index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from polar.evaluate import published_grading
from polar.rollout.taskfile import TaskFileError, load_tasks
from polar.task import Task
from tests.published_rows import (
    INSTANCES,
    PYTEST_RA,
    R2E_IMAGE,
    SWE,
    SWEBENCH_SPECS,
    SWESMITH_ID,
    SWESMITH_SPECS,
    SWESMITH_TEST_CMD,
    r2e_row,
    swebench_row,
    swesmith_row,
    write_jsonl,
)

IDS = list(INSTANCES)


def _task_file(
    tmp_path: Path, fmt: str, path: str, specs: dict[str, Any] | None = None, extra: str = ""
) -> Path:
    dataset: dict[str, Any] = {"format": fmt, "path": path}
    if specs is not None:
        dataset["specs"] = specs
    (tmp_path / "t.yaml").write_text(f"dataset: {json.dumps(dataset)}\n{extra}")
    return tmp_path / "t.yaml"


def _load(path: Path) -> list[Task]:
    return load_tasks(path, resolve_imports=False)


def test_swebench_rows_as_published_get_the_harness_spec(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "rows.jsonl", [swebench_row(i) for i in IDS])
    tasks = _load(_task_file(tmp_path, "swebench", "rows.jsonl", SWEBENCH_SPECS))
    assert [t.task_id for t in tasks] == IDS
    t = tasks[0]
    assert t.runtime.image == "swebench/sweb.eval.x86_64.polar-swe_1776_textstats-1:latest"
    assert (t.runtime.workdir, t.evaluator.strategy) == ("/testbed", "swebench")
    inst = t.evaluator.config["instance"]
    assert inst["FAIL_TO_PASS"] == INSTANCES[IDS[0]]["FAIL_TO_PASS"]  # decoded from the JSON text
    assert (
        "patch" not in inst
        and inst["log_parser"] == "parse_log_pytest"
        and inst["eval_type"] == "pass_and_fail"
    )
    script = inst["eval_script"]
    # swebench 4.1.0's script: its test files reset, the test patch applied, the spec's command on them.
    assert f"{PYTEST_RA} tests/test_textstats.py\n: '>>>>> End Test Output'" in script
    assert f"git checkout {inst['base_commit']} tests/test_textstats.py\ngit apply -v -" in script
    assert t.metadata["format"] == "swebench"


def test_a_known_repo_needs_no_spec(tmp_path: Path) -> None:
    """A SWE-bench Verified row (its shape; the text shortened) gets the harness's own django spec."""
    row = swebench_row(IDS[0]) | {
        "instance_id": "django__django-11099",
        "repo": "django/django",
        "version": "3.0",
    }
    row["test_patch"] = row["test_patch"].replace(
        "tests/test_textstats.py", "tests/auth_tests/test_validators.py"
    )
    write_jsonl(tmp_path / "rows.jsonl", [row])
    (task,) = _load(_task_file(tmp_path, "swebench", "rows.jsonl"))
    inst = task.evaluator.config["instance"]
    assert inst["log_parser"] == "parse_log_django"
    assert (
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 auth_tests.test_validators"
        in (inst["eval_script"])
    )


@pytest.mark.parametrize("form", ["parquet", "dataset", "dataset_dict"])
def test_parquet_and_datasets_folders_read_as_jsonl(tmp_path: Path, form: str) -> None:
    import datasets

    rows = [swebench_row(i) for i in IDS]
    data = datasets.Dataset.from_list(rows)
    if form == "parquet":
        data.to_parquet(str(tmp_path / "test.parquet"))
        path = "test.parquet"
    elif form == "dataset":
        data.save_to_disk(str(tmp_path / "verified"))
        path = "verified"
    else:
        datasets.DatasetDict({"test": data}).save_to_disk(str(tmp_path / "verified"))
        path = "verified"
    tasks = _load(_task_file(tmp_path, "swebench", path, SWEBENCH_SPECS, "defaults: {num_samples: 3}\n"))
    assert [t.task_id for t in tasks] == IDS and tasks[0].num_samples == 3
    write_jsonl(tmp_path / "rows.jsonl", rows)
    same = _load(
        _task_file(tmp_path, "swebench", "rows.jsonl", SWEBENCH_SPECS, "defaults: {num_samples: 3}\n")
    )
    assert [t.model_dump(exclude={"metadata"}) for t in tasks] == [
        t.model_dump(exclude={"metadata"}) for t in same
    ]


def test_a_repo_the_harness_does_not_know_names_the_row_and_the_fix(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "rows.jsonl", [swebench_row(i) for i in IDS])
    with pytest.raises(TaskFileError) as exc:
        _load(_task_file(tmp_path, "swebench", "rows.jsonl"))
    message = str(exc.value)
    assert message.startswith(
        f"{tmp_path}/t.yaml:1: dataset: {tmp_path}/rows.jsonl:1: polar-swe__textstats-1: "
    )
    assert "swebench 4.1.0 has no spec for repo polar/textstats version 1.0" in message
    assert "dataset.specs" in message and "log_parser: parse_log_pytest" in message


def test_datasets_folder_rows_are_named_by_index(tmp_path: Path) -> None:
    import datasets

    rows = [swebench_row(i) for i in IDS]
    rows[1] = rows[1] | {"problem_statement": " "}
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(
        TaskFileError, match=r"t.yaml:1: .*/d: row 1: polar-swe__textstats-2: no problem_statement"
    ):
        _load(_task_file(tmp_path, "swebench", "d", SWEBENCH_SPECS))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(TaskFileError, match=r"dataset.split: .*/dd has splits train, not 'test'"):
        _load(_task_file(tmp_path, "swebench", "dd", SWEBENCH_SPECS))


def test_swegym_rows_get_swegyms_images_and_need_specs(tmp_path: Path) -> None:
    row = swebench_row(IDS[0]) | {
        "instance_id": "getmoto__moto-5406",
        "repo": "getmoto/moto",
        "version": "4.0",
    }
    write_jsonl(tmp_path / "rows.jsonl", [row])
    with pytest.raises(
        TaskFileError, match=r"rows.jsonl:1: getmoto__moto-5406: .*no spec for repo getmoto/moto"
    ):
        _load(_task_file(tmp_path, "swegym", "rows.jsonl"))
    specs = {"getmoto/moto": {"4.0": {"test_cmd": "pytest -n0 -rA", "log_parser": "parse_log_pytest"}}}
    (task,) = _load(_task_file(tmp_path, "swegym", "rows.jsonl", specs))
    assert task.runtime.image == "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5406:latest"
    assert "pytest -n0 -rA tests/test_textstats.py" in task.evaluator.config["instance"]["eval_script"]


def test_swebench_5_rows_keep_their_own_script(tmp_path: Path) -> None:
    """Rows that carry swebench 5.x's eval_script (SWE-bench's own republished datasets) need no spec."""
    (tmp_path / "rows.jsonl").write_text((SWE / "instances.jsonl").read_text())
    tasks = _load(_task_file(tmp_path, "swebench", "rows.jsonl"))
    assert tasks[0].evaluator.config["instance"]["eval_script"] == INSTANCES[IDS[0]]["eval_script"]
    assert tasks[0].runtime.image == "polar-swe-textstats:1"


def test_swesmith_rows_get_their_image_branch_and_profile(tmp_path: Path) -> None:
    source = (SWE / "repos/textstats/textstats/__init__.py").read_text()
    write_jsonl(tmp_path / "rows.jsonl", [swesmith_row(source)])
    with pytest.raises(
        TaskFileError, match=rf"rows.jsonl:1: {SWESMITH_ID}: swesmith 0.0.9 has no profile for repo"
    ):
        _load(_task_file(tmp_path, "swesmith", "rows.jsonl"))
    (task,) = _load(_task_file(tmp_path, "swesmith", "rows.jsonl", SWESMITH_SPECS))
    assert task.task_id == SWESMITH_ID and task.runtime.image == "polar-swe-textstats:1"
    inst = task.evaluator.config["instance"]
    assert inst["grading"] == "swesmith" and inst["base_commit"] == "swesmith-base"
    assert inst["test_files"] == ["tests/test_textstats.py"]
    assert f": '>>>>> Start Test Output'\n{SWESMITH_TEST_CMD}\n" in inst["eval_script"]
    (prepare,) = task.runtime.prepare
    assert "git rm -q --ignore-unmatch tests/test_textstats.py" in prepare.cmd  # type: ignore[union-attr]


def test_a_known_swesmith_profile_gives_its_command(tmp_path: Path) -> None:
    row = swesmith_row("x") | {"repo": "swesmith/mewwts__addict.75284f95"}
    row["instance_id"] = "mewwts__addict.75284f95.func_pm_remove_assign__abc"
    write_jsonl(tmp_path / "rows.jsonl", [row])
    (task,) = _load(_task_file(tmp_path, "swesmith", "rows.jsonl"))
    assert (
        "pytest --disable-warnings --color=no --tb=no --verbose"
        in task.evaluator.config["instance"]["eval_script"]
    )


def test_r2egym_rows(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "rows.jsonl", [r2e_row()])
    (task,) = _load(_task_file(tmp_path, "r2egym", "rows.jsonl"))
    assert task.task_id == "textstats__" + "f" * 40 and task.runtime.image == R2E_IMAGE
    assert (
        task.instruction.strip() == INSTANCES[IDS[0]]["problem_statement"].strip()
    )  # R2E-Gym's [ISSUE] text
    inst = task.evaluator.config["instance"]
    assert inst["grading"] == "r2egym" and inst["expected_output"]["test_mean_word_length"] == "PASSED"
    assert "bash /root/run_tests.sh" in inst["eval_script"]
    write_jsonl(tmp_path / "rows.jsonl", [r2e_row(), r2e_row() | {"expected_output_json": "{"}])
    with pytest.raises(
        TaskFileError, match=r"rows.jsonl:2: expected_output_json or parsed_commit_content is not JSON"
    ):
        _load(_task_file(tmp_path, "r2egym", "rows.jsonl"))


def test_the_publishers_log_rules() -> None:
    smith = (
        "+ : '>>>>> Start Test Output'\ntests/t.py::test_a PASSED [ 50%]\ntests/t.py::test_b FAILED [100%]\n"
        "+ : '>>>>> End Test Output'\ntests/t.py::test_c PASSED\n"
    )
    assert published_grading.swesmith_statuses(smith) == {
        "tests/t.py::test_a": "PASSED",
        "tests/t.py::test_b": "FAILED",
    }
    assert published_grading.swesmith_statuses("no markers") is None
    resolved, _ = published_grading.swesmith_resolved({"a": "PASSED", "b": "SKIPPED"}, ["b"], ["a"])
    assert not resolved  # a skipped FAIL_TO_PASS test does not resolve (swebench 5's rule)
    r2e = (
        "collected 3 items\n== short test summary info ==\nPASSED r2e_tests/test_1.py::test_a\n"
        "FAILED r2e_tests/test_1.py::TestK::test_b - assert 1 == 2\n\x1b[31mERROR\x1b[0m r2e_tests/test_1.py::test_c\r\n"
    )
    statuses = published_grading.r2e_statuses(r2e)
    assert statuses == {"test_a": "PASSED", "TestK.test_b": "FAILED", "test_c": "ERROR"}
    assert published_grading.r2e_matches(statuses, dict(statuses)) == (True, [])
    assert published_grading.r2e_matches(statuses, {"test_a": "PASSED"}) == (
        False,
        ["TestK.test_b", "test_c"],
    )
    assert published_grading.r2e_matches({"test_a": "PASSED"}, {"test_a": "FAILED"}) == (False, ["test_a"])
