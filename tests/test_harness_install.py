"""Pinned harness programs install once, into a shared cache, even when sessions race for them."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from polar.harness.install import InstallError, find_python, npm_bin, npm_prefix, pip_prefix, python_prefix


def test_npm_install_is_cached_and_race_free(tmp_path: Path) -> None:
    with ThreadPoolExecutor(3) as pool:
        prefixes = list(pool.map(lambda _: npm_prefix("semver", "7.6.3", root=tmp_path), range(3)))
    assert len(set(prefixes)) == 1
    prefix = prefixes[0]
    assert (prefix / ".polar-installed").read_text().strip() == "semver@7.6.3"
    binary = npm_bin("semver", "7.6.3", "semver", root=tmp_path)
    out = subprocess.run([str(binary), "1.2.3", "-i", "minor"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1.3.0"
    mtime = (prefix / ".polar-installed").stat().st_mtime
    assert npm_prefix("semver", "7.6.3", root=tmp_path) == prefix  # reused, not reinstalled
    assert (prefix / ".polar-installed").stat().st_mtime == mtime
    leftovers = [
        p for p in (tmp_path / "npm").iterdir() if p.name.startswith(".semver") and p.suffix != ".lock"
    ]
    assert leftovers == []  # no temporary install folder left behind


def test_pip_install_into_a_target_prefix(tmp_path: Path) -> None:
    prefix = pip_prefix("six", "1.16.0", root=tmp_path)
    code = "import six; print(six.__version__, six.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(prefix)}
    )
    assert out.stdout.startswith("1.16.0 " + str(prefix))


def test_an_install_is_readable_by_a_sandbox_uid_even_if_cached_before(tmp_path: Path) -> None:
    """Sandboxes run the program as an unprivileged uid of their own: the prefix (made by mkdtemp, 0700)
    must be 0755, and a cache installed before that rule is mended on its next use."""
    prefix = pip_prefix("six", "1.16.0", root=tmp_path)
    assert prefix.stat().st_mode & 0o777 == 0o755
    prefix.chmod(0o700)  # as older polar left it
    assert pip_prefix("six", "1.16.0", root=tmp_path) == prefix
    assert prefix.stat().st_mode & 0o777 == 0o755


def test_failures_are_clear_and_leave_nothing(tmp_path: Path) -> None:
    with pytest.raises(InstallError, match=r"no-such-polar-package-xyz@1\.0\.0"):
        npm_prefix("no-such-polar-package-xyz", "1.0.0", root=tmp_path)
    assert [p.name for p in (tmp_path / "npm").iterdir() if not p.name.endswith(".lock")] == []
    npm_prefix("semver", "7.6.3", root=tmp_path)
    with pytest.raises(InstallError, match="no binary named 'nope'"):
        npm_bin("semver", "7.6.3", "nope", root=tmp_path)


def test_find_python_takes_only_the_version_asked_for() -> None:
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert find_python(minor, sys.executable) == Path(sys.executable)
    tried = re.escape(f"(tried {sys.executable})")
    with pytest.raises(InstallError, match=rf"no Python 3\.99 found on this node {tried}"):
        find_python("3.99", sys.executable)
    with pytest.raises(InstallError, match=r"no Python 3\.99 found"):  # PATH, pyenv and uv have none
        find_python("3.99")


def test_a_python_copy_that_fails_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(InstallError, match=r"installing six==1\.16\.0 failed"):
        python_prefix("six", "1.16.0", Path("/bin/false"), root=tmp_path)
    assert [p.name for p in (tmp_path / "python").iterdir() if not p.name.endswith(".lock")] == []
