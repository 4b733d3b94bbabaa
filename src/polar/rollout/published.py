"""Published SWE datasets, read as their publishers release them: each row's image and grading.

Every shape becomes the `swebench` evaluator's instance (`polar.evaluate.swebench`), graded in a fresh
container of the row's image with the agent's diff (test files left out); what differs is where the image,
the eval script and the grading rule come from. The facts relied on, and where they come from:

- **SWE-bench** (Verified, Lite, full; `princeton-nlp/*` and `SWE-bench/*` on the Hugging Face hub, as
  jsonl, parquet or a `datasets` save_to_disk folder): `instance_id`, `repo`, `base_commit`, `patch`,
  `test_patch`, `problem_statement`, `hints_text`, `created_at`, `version`, `FAIL_TO_PASS` and
  `PASS_TO_PASS` (JSON text), `environment_setup_commit` (the datasets' cards). Image:
  `swebench/sweb.eval.x86_64.<instance_id, "__" as "_1776_">:latest` (swebench's `ImageSpec.name`). The
  eval script and log parser are swebench 4.1.0's for the row's repo and version (`published_specs`);
  rows that already carry swebench 5.x's `eval_script`, `log_parser`, `eval_type` are used as they are.
- **SWE-Gym** (`SWE-Gym/SWE-Gym`, `SWE-Gym/SWE-Gym-Lite`, SkyRL's subsets): SWE-bench's columns for repos
  swebench does not know (getmoto/moto, python/mypy, pydantic/pydantic, ...): their specs come from the
  task file's `dataset.specs`. Image: `xingyaoww/sweb.eval.x86_64.<instance_id, "__" as "_s_">:latest`
  (the name SkyRL, mini-swe-agent and OpenHands' benchmarks give SWE-Gym instances).
- **SWE-smith** (`SWE-bench/SWE-smith`; swesmith's `harness/gather.py` writes the rows): `instance_id`
  (`<owner>__<repo>.<commit[:8]>.<bug>`), `repo` (`swesmith/<owner>__<repo>.<commit[:8]>`), `patch` (the
  diff that *creates* the bug), `FAIL_TO_PASS`, `PASS_TO_PASS`, `image_name`, `problem_statement`. The
  image holds the repository at its commit; swesmith's harness fetches the instance's branch (bug commit,
  then a commit removing the FAIL_TO_PASS test files) from its GitHub mirror. polar builds the same two
  commits from the row's `patch` (no network), runs the profile's test command between the markers with
  the test files restored, and grades as swesmith's `get_eval_report` does: its Python profiles' log
  parser (`<test> <STATUS>` lines of `pytest --verbose`), then FAIL_TO_PASS and PASS_TO_PASS all passing.
- **R2E-Gym** (`R2E-Gym/R2E-Gym-Lite`, `-Subset`, `-Full`): `repo_name`, `docker_image`, `commit_hash`,
  `problem_statement`, `expected_output_json`, `parsed_commit_content` (whose `old_commit_hash` is the
  image's checkout). The image holds `/testbed/run_tests.sh` and the hidden tests in `/r2e_tests`; R2E-Gym's
  `DockerRuntime.setup_env` moves both under `/root` and links `/testbed/r2e_tests` to them, and its reward
  (`_calculate_reward_r2e`) is 1 when the statuses parsed from `run_tests.sh`'s output (its pytest summary
  parser, keys cut at " - ") equal `expected_output_json` exactly, same tests, same statuses.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from polar.rollout import published_specs

Row = tuple[str, dict[str, Any]]  # (where the row is: file:line or file: row N, the row)

START, END = ">>>>> Start Test Output", ">>>>> End Test Output"
SWESMITH_BASE = "swesmith-base"
_IDENTITY = "-c user.name=polar -c user.email=polar@example.invalid"


class ShapeError(ValueError):
    """A row that cannot become a task; the message names the row and what to do."""


def swebench_image(instance_id: str) -> str:
    """SWE-bench's name for an instance's evaluation image on Docker Hub (x86_64)."""
    return f"swebench/sweb.eval.x86_64.{instance_id.lower().replace('__', '_1776_')}:latest"


def swegym_image(instance_id: str) -> str:
    """The name SWE-Gym's evaluation images are published under on Docker Hub."""
    return f"xingyaoww/sweb.eval.x86_64.{instance_id.lower().replace('__', '_s_')}:latest"


def _text(where: str, row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ShapeError(f"{where}: {key} is missing or empty")
    return value


def _tests(where: str, row: dict[str, Any], key: str) -> list[str]:
    value = row.get(key, [])
    if isinstance(value, str):  # JSON text in the hub releases
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ShapeError(f"{where}: {key} is neither a list nor JSON text of one") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ShapeError(f"{where}: {key} must be a list of test names")
    return value


def _version(row: dict[str, Any]) -> str:
    v = row.get("version", "")
    return v if isinstance(v, str) else str(v)


def _fail_only_repos() -> frozenset[str]:
    try:
        from swebench.harness.constants import FAIL_ONLY_REPOS
    except ImportError:
        raise ShapeError(
            "grading SWE-bench rows needs the swebench package: pip install 'polar-rl[swe]'"
        ) from None
    return frozenset(FAIL_ONLY_REPOS)


def _spec_hint(repo: str, version: str) -> str:
    return (
        f"give its spec under dataset.specs in swebench's MAP_REPO_VERSION_TO_SPECS shape, e.g. specs: "
        f"{{{repo}: {{'{version}': {{test_cmd: 'pytest -rA', log_parser: parse_log_pytest}}}}}}"
    )


def swebench_instances(rows: list[Row], specs: dict[str, Any], gym: bool) -> list[dict[str, Any]]:
    """The `swebench` evaluator's instance of each SWE-bench (or SWE-Gym) row."""
    classic = [(w, r) for w, r in rows if not r.get("eval_script")]
    request = []
    for where, row in classic:
        request.append(
            {
                "instance_id": row["instance_id"],
                "repo": _text(where, row, "repo"),
                "version": _version(row),
                "base_commit": _text(where, row, "base_commit"),
                "test_patch": _text(where, row, "test_patch"),
            }
        )
    try:
        answers = iter(published_specs.build("swebench", request, specs))
    except published_specs.SpecError as exc:
        raise ShapeError(str(exc)) from None
    fail_only = _fail_only_repos() if classic else frozenset()
    out = []
    for where, row in rows:
        iid = row["instance_id"]
        image = row.get("image") or (swegym_image(iid) if gym else swebench_image(iid))
        inst: dict[str, Any] = {
            "instance_id": iid,
            "repo": _text(where, row, "repo"),
            "version": _version(row),
            "base_commit": _text(where, row, "base_commit"),
            "test_patch": _text(where, row, "test_patch"),
            "FAIL_TO_PASS": _tests(where, row, "FAIL_TO_PASS"),
            "PASS_TO_PASS": _tests(where, row, "PASS_TO_PASS"),
            "image": image,
        }
        if row.get("eval_script"):  # swebench 5.x's own fields
            inst |= {k: row[k] for k in ("eval_script", "log_parser", "eval_type") if k in row}
        else:
            answer = next(answers)
            if answer.get("error") == "unknown":
                known = ", ".join(answer.get("known_versions") or []) or "none"
                raise ShapeError(
                    f"{where}: {iid}: swebench {published_specs.SWEBENCH_PIN} has no spec for repo "
                    f"{inst['repo']} version {inst['version']} (versions it knows: {known}); "
                    + _spec_hint(inst["repo"], inst["version"])
                )
            if answer.get("error") == "no_parser":
                raise ShapeError(
                    f"{where}: {iid}: swebench {published_specs.SWEBENCH_PIN} has no log parser for repo "
                    f"{inst['repo']}; name one in its dataset.specs entry (log_parser: parse_log_pytest)"
                )
            if "error" in answer:
                raise ShapeError(
                    f"{where}: {iid}: swebench could not build its eval script: {answer['message']}"
                )
            inst["eval_script"] = answer["eval_script"]
            inst["log_parser"] = answer["log_parser"]
            inst["eval_type"] = "fail_only" if inst["repo"] in fail_only else "pass_and_fail"
        out.append(inst)
    return out


def _script(*lines: str) -> str:
    return "\n".join(["#!/bin/bash", "set -uxo pipefail", *lines]) + "\n"


def swesmith_instances(rows: list[Row], specs: dict[str, Any]) -> list[tuple[dict[str, Any], list[str]]]:
    """(the evaluator's instance, the prepare commands) of each SWE-smith row."""
    request = []
    for where, row in rows:
        for key in ("repo", "patch", "image_name"):
            _text(where, row, key)
        request.append(
            {
                "instance_id": row["instance_id"],
                "repo": row["repo"],
                "patch": row["patch"],
                "FAIL_TO_PASS": _tests(where, row, "FAIL_TO_PASS"),
                "PASS_TO_PASS": _tests(where, row, "PASS_TO_PASS"),
            }
        )
    try:
        answers = published_specs.build("swesmith", request, specs)
    except published_specs.SpecError as exc:
        raise ShapeError(str(exc)) from None
    out = []
    for (where, row), req, answer in zip(rows, request, answers, strict=True):
        iid, repo = row["instance_id"], row["repo"]
        if answer.get("error") == "unknown":
            raise ShapeError(
                f"{where}: {iid}: swesmith {published_specs.SWESMITH_PIN} has no profile for repo {repo}; "
                f"give one under dataset.specs: {{{repo}: {{test_cmd: 'pytest --disable-warnings --color=no "
                "--tb=no --verbose'}}"
            )
        if "error" in answer:
            raise ShapeError(f"{where}: {iid}: swesmith could not give its test command: {answer['message']}")
        if not answer["python"]:
            raise ShapeError(
                f"{where}: {iid}: its profile {answer['profile']} is not a Python profile; polar grades "
                "SWE-smith's Python profiles (their log parser) only"
            )
        f2p = [shlex.quote(f) for f in answer["f2p_files"]]
        prepare = [
            # The instance branch swesmith's mirror holds: the bug committed, then the failing tests removed.
            f"git apply --index - <<'EOF_POLAR_SWESMITH'\n{row['patch']}\nEOF_POLAR_SWESMITH\n"
            f"git {_IDENTITY} commit -qm 'SWE-smith bug' --no-verify"
            + (f" && git rm -q --ignore-unmatch {' '.join(f2p)}" if f2p else "")
            + f" && git {_IDENTITY} commit -q --allow-empty -m 'Remove F2P tests' --no-verify"
            + f" && git tag -f {SWESMITH_BASE} >/dev/null",
        ]
        restore = f"git checkout {SWESMITH_BASE}~1 -- {' '.join(f2p)}" if f2p else "true"
        inst = {
            "instance_id": iid,
            "repo": repo,
            "version": "",
            "base_commit": SWESMITH_BASE,
            "test_patch": "",
            "test_files": answer["test_files"],
            "FAIL_TO_PASS": req["FAIL_TO_PASS"],
            "PASS_TO_PASS": req["PASS_TO_PASS"],
            "log_parser": "swesmith_python",
            "eval_type": "pass_and_fail",
            "grading": "swesmith",
            "image": row["image_name"],
            "eval_script": _script("cd /testbed", restore, f": '{START}'", answer["test_cmd"], f": '{END}'"),
        }
        out.append((inst, prepare))
    return out


# R2E-Gym's DockerRuntime.setup_env for its own images: the runner and the hidden tests go under /root,
# the tests linked back into the repository where run_tests.sh looks for them.
R2E_SETUP = (
    "mv /testbed/run_tests.sh /root/run_tests.sh 2>/dev/null; "
    "if [ -d /r2e_tests ]; then rm -rf /root/r2e_tests && mv /r2e_tests /root/r2e_tests; fi; "
    "ln -sfn /root/r2e_tests /testbed/r2e_tests; "
    "test -f /root/run_tests.sh && test -d /root/r2e_tests"
)


def r2e_task_id(row: dict[str, Any]) -> str:
    return f"{row.get('repo_name')}__{row.get('commit_hash')}"


def r2egym_instance(where: str, row: dict[str, Any]) -> dict[str, Any]:
    """The evaluator's instance of an R2E-Gym row (its prepare is `R2E_SETUP`)."""
    repo = _text(where, row, "repo_name")
    _text(where, row, "commit_hash")
    try:
        expected = json.loads(_text(where, row, "expected_output_json"))
        parsed = json.loads(_text(where, row, "parsed_commit_content"))
    except json.JSONDecodeError as exc:
        raise ShapeError(
            f"{where}: expected_output_json or parsed_commit_content is not JSON: {exc}"
        ) from None
    if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
        raise ShapeError(f"{where}: expected_output_json must map test names to statuses")
    base = parsed.get("old_commit_hash") if isinstance(parsed, dict) else None
    if not isinstance(base, str) or not base:
        raise ShapeError(f"{where}: parsed_commit_content has no old_commit_hash (the image's checkout)")
    return {
        "instance_id": r2e_task_id(row),
        "repo": repo,
        "version": "",
        "base_commit": base,
        "test_patch": "",
        "test_files": ["r2e_tests", "run_tests.sh", ".venv"],
        "FAIL_TO_PASS": [],
        "PASS_TO_PASS": [],
        "log_parser": "r2egym_pytest",
        "eval_type": "pass_and_fail",
        "grading": "r2egym",
        "expected_output": expected,
        "image": _text(where, row, "docker_image"),
        "eval_script": _script("cd /testbed", f": '{START}'", "bash /root/run_tests.sh", f": '{END}'"),
    }


_ISSUE = re.compile(r"\[ISSUE\](.*)\[/ISSUE\]", re.DOTALL)


def r2egym_instruction(statement: str) -> str:
    """What R2E-Gym shows its agent: the text between [ISSUE] and [/ISSUE] where the statement has them."""
    found = _ISSUE.search(statement)
    return found.group(1) if found else statement
