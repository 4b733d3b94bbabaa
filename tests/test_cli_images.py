"""`polar images base`: a Debian base image built here (mmdebstrap) and imported into an engine."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from polar.cli import main
from polar.runtime.images import BaseImage, default_cache


def test_help_shows_examples() -> None:
    for args in (["images", "--help"], ["images", "base", "--help"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and "Examples:" in result.output and "polar images base" in result.output


def test_user_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(main, ["images", "base", "--include", " , "])
    assert result.exit_code == 2 and "name at least one package" in result.output
    # No mmdebstrap and no image yet: says what to install, no traceback.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").symlink_to("/bin/false")  # `image inspect` fails: the image is missing
    monkeypatch.setenv("PATH", str(bindir))
    result = CliRunner().invoke(
        main, ["images", "base", "--engine", "docker", "--cache", str(tmp_path / "c")]
    )
    assert result.exit_code == 1
    assert "needs mmdebstrap (Debian/Ubuntu: apt-get install mmdebstrap)" in result.output
    assert "Traceback" not in result.output


@pytest.mark.containers
def test_an_image_is_imported_from_the_cached_root_file_system(podman_engine: str) -> None:
    """The engine fixture built polar's base (and cached its archive); another tag imports that archive."""
    tag = "polar-test-images:1"
    subprocess.run([podman_engine, "rmi", "-f", tag], capture_output=True, check=False)
    cached = default_cache() / BaseImage().rootfs_name()
    assert cached.is_file()
    before = cached.stat().st_mtime_ns
    try:
        result = CliRunner().invoke(main, ["images", "base", "--engine", podman_engine, "--tag", tag])
        assert result.exit_code == 0, result.output
        assert f"reusing {cached}" in result.output and f"imported into podman as {tag}" in result.output
        assert cached.stat().st_mtime_ns == before  # not rebuilt, not rewritten
        run = subprocess.run(
            [podman_engine, "run", "--rm", tag, "python3", "-c", "print('ok')"],
            capture_output=True,
            text=True,
        )
        assert run.stdout == "ok\n", run.stderr
        again = CliRunner().invoke(main, ["images", "base", "--engine", podman_engine, "--tag", tag])
        assert again.exit_code == 0 and f"podman already has {tag}" in again.output
    finally:
        subprocess.run([podman_engine, "rmi", "-f", tag], capture_output=True, check=False)
