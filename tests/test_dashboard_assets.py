"""The dashboard's vendored browser code is exactly what web/package-lock.json pins: each shipped file
hashes to the manifest `scripts/build-dashboard` wrote, and the manifest names the lockfile's versions and
tarball integrity. The templates and static files are package data, so `pip install` ships them."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "src" / "polar" / "dashboard" / "static" / "vendor"


def _manifest() -> dict[str, dict[str, str]]:
    data: dict[str, dict[str, str]] = json.loads((VENDOR / "MANIFEST.json").read_text())
    return data


def test_vendored_files_match_the_manifest_and_the_lockfile() -> None:
    manifest = _manifest()
    lock = json.loads((ROOT / "web" / "package-lock.json").read_text())["packages"]
    pinned = json.loads((ROOT / "web" / "package.json").read_text())["dependencies"]
    assert {m["package"] for m in manifest.values()} == set(pinned)
    for name, m in manifest.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == m["sha256"], name
        entry = lock[f"node_modules/{m['package']}"]
        assert (m["version"], m["integrity"]) == (entry["version"], entry["integrity"]), name
        assert pinned[m["package"]] == entry["version"]  # exact pins, no ranges
    shipped = {p.name for p in VENDOR.iterdir() if p.suffix in (".js", ".css")}
    assert shipped == set(manifest)  # nothing vendored that the manifest does not account for


def test_vendored_files_are_the_built_ones_when_node_modules_is_here() -> None:
    modules = ROOT / "web" / "node_modules"
    if not modules.is_dir():
        pytest.skip("web/node_modules is absent: run scripts/build-dashboard to compare")
    for name, m in _manifest().items():
        built = modules / m["package"] / m["path"]
        assert built.read_bytes() == (VENDOR / name).read_bytes(), name


def test_templates_and_static_files_are_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["polar"]
    package = ROOT / "src" / "polar"
    covered = {p for g in globs for p in package.glob(g) if p.is_file()}
    needed = {
        p
        for sub in ("templates", "static")
        for p in (package / "dashboard" / sub).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert needed and needed <= covered, sorted(str(p) for p in needed - covered)
