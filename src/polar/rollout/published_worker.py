"""Run by `polar.rollout.published_specs` in a child process whose `swebench` is the pinned classic harness.

Not imported by polar: the child's PYTHONPATH puts the pinned releases (swebench 4.1.0, swesmith 0.0.9, each
installed without dependencies) before the environment's own swebench 5.x, which builds no test spec from a
published row. Reads `{"shape": ..., "rows": [...], "specs": {...}}` as JSON on stdin and writes one JSON
object per row (`{"error": ...}` for a row the harness cannot handle) as a list on stdout.

- swebench (SWE-bench, SWE-Gym): `specs` ({repo: {version: spec}}, the shape of the harness's
  `MAP_REPO_VERSION_TO_SPECS`) is merged into the harness's tables, since its script builder reads the test
  command from them; each row gets the eval script the harness's `make_eval_script_list` writes (joined as
  its `TestSpec.eval_script` does) and the name of its log parser (`MAP_REPO_TO_PARSER`, or the spec's
  `log_parser`).
- swesmith: each row's profile (`swesmith.profiles.registry`, by the row's `repo`; `specs` ({repo: {test_cmd}})
  registers a Python profile for a repository SWE-smith does not know) gives the test command
  (`get_test_cmd`), the test files of FAIL_TO_PASS and PASS_TO_PASS (`get_test_files`) and its kind.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _swebench(rows: list[dict[str, Any]], specs: dict[str, Any]) -> list[dict[str, Any]]:
    from swebench.harness.constants import MAP_REPO_TO_EXT, MAP_REPO_VERSION_TO_SPECS
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER
    from swebench.harness.test_spec.create_scripts import make_eval_script_list
    from swebench.harness.test_spec.test_spec import TestSpec

    parsers: dict[str, str] = {}
    for repo, versions in specs.items():
        for version, spec in versions.items():
            MAP_REPO_VERSION_TO_SPECS.setdefault(repo, {})[version] = {
                k: v for k, v in spec.items() if k != "log_parser"
            }
            if "log_parser" in spec:
                parsers[repo] = spec["log_parser"]
        MAP_REPO_TO_EXT.setdefault(repo, "py")
    out: list[dict[str, Any]] = []
    for row in rows:
        repo, version = row["repo"], row["version"]
        spec = MAP_REPO_VERSION_TO_SPECS.get(repo, {}).get(version)
        if spec is None:
            known = sorted(MAP_REPO_VERSION_TO_SPECS.get(repo, {}))
            out.append({"error": "unknown", "known_versions": known})
            continue
        parser = parsers.get(repo) or getattr(MAP_REPO_TO_PARSER.get(repo), "__name__", None)
        if parser is None:
            out.append({"error": "no_parser"})
            continue
        try:
            lines = make_eval_script_list(
                row, spec, "testbed", "/testbed", row["base_commit"], row["test_patch"]
            )
        except Exception as exc:  # the harness's own message, reported at the row
            out.append({"error": "harness", "message": f"{type(exc).__name__}: {exc}"})
            continue
        test_spec = TestSpec(
            instance_id=row["instance_id"],
            repo=repo,
            version=version,
            repo_script_list=[],
            eval_script_list=lines,
            env_script_list=[],
            arch="x86_64",
            FAIL_TO_PASS=[],
            PASS_TO_PASS=[],
            language=MAP_REPO_TO_EXT[repo],
            docker_specs={},
            namespace=None,
        )
        out.append({"eval_script": test_spec.eval_script, "log_parser": parser})
    return out


def _register(repo: str, spec: dict[str, Any]) -> None:
    """A Python profile for `repo` (SWE-smith's `swesmith/<owner>__<name>.<commit[:8]>`)."""
    from dataclasses import field, make_dataclass

    from swesmith.profiles.base import registry
    from swesmith.profiles.python import PythonProfile

    owner, _, rest = repo.removeprefix("swesmith/").partition("__")
    name, _, commit = rest.rpartition(".")
    fields = [("owner", str, field(default=owner)), ("repo", str, field(default=name))]
    fields += [("commit", str, field(default=commit)), ("test_cmd", str, field(default=spec["test_cmd"]))]
    registry.register_profile(make_dataclass(f"Polar_{len(registry)}", fields, bases=(PythonProfile,)))


def _swesmith(rows: list[dict[str, Any]], specs: dict[str, Any]) -> list[dict[str, Any]]:
    from swesmith.profiles import registry

    for repo, spec in specs.items():
        _register(repo, spec)
    out: list[dict[str, Any]] = []
    for row in rows:
        try:
            profile = registry.get_from_inst(row)
        except KeyError:
            out.append({"error": "unknown"})
            continue
        try:
            test_cmd, _ = profile.get_test_cmd(row)
            f2p, p2p = profile.get_test_files(row)
        except Exception as exc:
            out.append({"error": "harness", "message": f"{type(exc).__name__}: {exc}"})
            continue
        kinds = [c.__name__ for c in type(profile).__mro__]
        out.append(
            {
                "test_cmd": test_cmd,
                "test_files": sorted({*map(str, f2p), *map(str, p2p)}),
                "f2p_files": sorted(map(str, f2p)),
                "python": "PythonProfile" in kinds,
                "profile": type(profile).__name__,
            }
        )
    return out


def main() -> None:
    import swebench

    request = json.load(sys.stdin)
    pinned = request.get("swebench_version")
    if pinned and swebench.__version__ != pinned:
        raise SystemExit(f"imported swebench {swebench.__version__} from {swebench.__file__}, not {pinned}")
    handler = {"swebench": _swebench, "swesmith": _swesmith}[request["shape"]]
    json.dump(handler(request["rows"], request.get("specs") or {}), sys.stdout)


if __name__ == "__main__":
    main()
