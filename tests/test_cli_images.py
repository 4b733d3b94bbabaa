"""`polar images base`: a Debian base image built here (mmdebstrap) and imported into an engine.
`polar images build`: the images a task file's tasks run in, built from their Dockerfiles with a cache."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from polar.cli import main
from polar.runtime.base import RuntimeFailure
from polar.runtime.images import (
    BUILD_LABEL,
    BaseImage,
    build_hash,
    build_image,
    default_cache,
    dockerfile_bases,
)


def test_help_shows_examples() -> None:
    for args, example in (
        (["images", "--help"], "polar images base"),
        (["images", "base", "--help"], "polar images base"),
        (["images", "build", "--help"], "polar images build"),
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and "Examples:" in result.output and example in result.output


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
    assert result.exit_code == 2
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


# -- polar images build ----------------------------------------------------------------------------------


def test_the_images_a_dockerfile_starts_from() -> None:
    text = (
        "# FROM commented:1\nARG V=1\nFROM --platform=linux/amd64 polar-base:bookworm AS deps\n"
        "RUN true\nFROM deps\nFROM scratch\nfrom \\\n  other:2 as final\nFROM img:$V\nFROM polar-base:bookworm\n"
    )
    assert dockerfile_bases(text) == ["polar-base:bookworm", "other:2"]


def test_the_build_hash_follows_what_a_build_reads(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "sub").mkdir(parents=True)
    (ctx / "Dockerfile").write_text("FROM polar-base:bookworm\nCOPY . /app\n")
    (ctx / "sub" / "a.sh").write_text("echo a\n")

    def digest(bases: tuple[str, ...] = ("sha256:1",)) -> str:
        return build_hash(ctx, ctx / "Dockerfile", bases)

    first = digest()
    assert digest() == first
    assert digest(("sha256:2",)) != first  # the base image was rebuilt
    (ctx / "sub" / "a.sh").chmod(0o755)
    moded = digest()
    assert moded != first
    (ctx / "sub" / "a.sh").write_text("echo b\n")
    assert digest() != moded
    (ctx / "sub" / "a.sh").rename(ctx / "sub" / "b.sh")
    renamed = digest()
    (ctx / "empty").mkdir()
    assert digest() != renamed


def _taskfile(tmp_path: Path, *tasks: str) -> Path:
    path = tmp_path / "tasks.yaml"
    path.write_text("tasks:\n" + "".join(tasks))
    return path


def _task(task_id: str, image: str, build: str = "", backend: str = "docker") -> str:
    text = f"  - task_id: {task_id}\n    instruction: x\n    runtime:\n      backend: {backend}\n"
    text += f"      image: {image}\n"
    return text + (f"      build: {build}\n" if build else "")


def test_task_file_mistakes_are_one_line(tmp_path: Path) -> None:
    bad = _taskfile(tmp_path, _task("a", "img:1", "{context: ctx, dockerfil: D}"))
    result = CliRunner().invoke(main, ["images", "build", str(bad)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (
        f"{bad}:7: tasks[0].runtime.build.dockerfil: Extra inputs are not permitted (did you mean dockerfile?)"
        in (result.output)
    )

    twice = _taskfile(
        tmp_path,
        _task("a", "img:1", "{context: one}"),
        _task("b", "img:1", "{context: one}"),  # the same build: one image
        _task("c", "img:1", "{context: two, dockerfile: D}"),
    )
    result = CliRunner().invoke(main, ["images", "build", str(twice)])
    assert result.exit_code == 2
    assert (
        f"img:1 is built two ways: task a from {tmp_path}/one/Dockerfile, task c from {tmp_path}/two/D"
        in (result.output)
    )
    result = CliRunner().invoke(main, ["images", "build", str(twice), "--only", "nope"])
    assert result.exit_code == 2 and "no task nope in" in result.output


# A tiny image on polar's base, tagged per test so tests never share one.
DOCKERFILE = "FROM polar-base:bookworm\nCOPY . /ctx\nRUN cat /ctx/msg.txt > /built.txt\n"


def _context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    (ctx / "msg.txt").write_text("one\n")
    return ctx


def _image_id(engine: str, tag: str) -> str:
    done = subprocess.run(
        [engine, "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True
    )
    return done.stdout.strip()


@pytest.fixture
def tag(request: pytest.FixtureRequest) -> Iterator[str]:
    """A tag of this test's own, removed afterwards from whichever engines have it."""
    name = (
        f"polar-test-build-{request.node.name.lower().replace('[', '-').rstrip(']')}:{uuid.uuid4().hex[:8]}"
    )
    yield name
    for engine in ("docker", "podman"):
        for image in (name, f"{name}-broken"):
            try:
                subprocess.run([engine, "rmi", "-f", image], capture_output=True, check=False)
            except FileNotFoundError:
                pass


@pytest.mark.containers
def test_an_image_is_built_once_and_again_when_its_context_changes(
    engine: str, tag: str, tmp_path: Path
) -> None:
    ctx = _context(tmp_path)
    first = build_image(engine, tag, ctx)
    assert first.built and first.image_id == _image_id(engine, tag)
    run = subprocess.run([engine, "run", "--rm", tag, "cat", "/built.txt"], capture_output=True, text=True)
    assert run.stdout == "one\n", run.stderr
    labels = subprocess.run(
        [engine, "image", "inspect", "--format", "{{json .Config.Labels}}", tag],
        capture_output=True,
        text=True,
    )
    assert BUILD_LABEL in labels.stdout

    again = build_image(engine, tag, ctx)
    assert not again.built and again.image_id == first.image_id

    (ctx / "msg.txt").write_text("two\n")
    changed = build_image(engine, tag, ctx)
    assert changed.built and changed.image_id != first.image_id
    run = subprocess.run([engine, "run", "--rm", tag, "cat", "/built.txt"], capture_output=True, text=True)
    assert run.stdout == "two\n", run.stderr

    forced = build_image(engine, tag, ctx, force=True)  # no layer cache: a new image of the same files
    assert forced.built and forced.image_id != changed.image_id


@pytest.mark.containers
def test_build_failures_say_what_is_wrong(docker_engine: str, tag: str, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    with pytest.raises(RuntimeFailure, match=f"cannot build {tag}: there is no Dockerfile at {ctx}/Other"):
        build_image(docker_engine, tag, ctx, "Other")
    with pytest.raises(RuntimeFailure, match=r"its build context .*/nowhere is not a directory"):
        build_image(docker_engine, tag, tmp_path / "nowhere")
    (ctx / "Dockerfile").write_text("FROM polar-no-such-base:7\nRUN true\n")
    with pytest.raises(RuntimeFailure) as exc:
        build_image(docker_engine, tag, ctx)
    assert f"cannot build {tag}: its base image polar-no-such-base:7" in str(exc.value)
    assert "polar images base --engine docker --tag polar-no-such-base:7" in str(exc.value)
    marker = f"doomed-step-{uuid.uuid4().hex}"
    (ctx / "Dockerfile").write_text(f"FROM polar-base:bookworm\nRUN echo {marker} && exit 3\n")
    with pytest.raises(RuntimeFailure) as exc:
        build_image(docker_engine, tag, ctx)
    assert f"building {tag} with docker failed (exit 3)" in str(exc.value) and marker in str(exc.value)
    # docker's legacy builder keeps the container of a failed step unless told --force-rm.
    left = subprocess.run(
        [docker_engine, "ps", "-a", "--no-trunc", "--format", "{{.Command}}"], capture_output=True, text=True
    )
    assert marker not in left.stdout


@pytest.mark.containers
def test_the_cli_builds_what_a_task_file_needs(docker_engine: str, tag: str, tmp_path: Path) -> None:
    _context(tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "Dockerfile").write_text("FROM polar-base:bookworm\nRUN exit 9\n")
    tasks = _taskfile(
        tmp_path,
        _task("a", tag, "{context: ctx}"),
        _task("b", tag, "{context: ctx}"),
        _task("c", "polar-base:bookworm"),  # no build: present
        _task("d", "polar-test-absent:1"),  # no build, not there: missing
        _task("e", tag + "-broken", "{context: broken}"),
        "  - task_id: f\n    instruction: x\n",  # runs in no container
    )
    result = CliRunner().invoke(main, ["images", "build", str(tasks)])
    out = result.output
    assert result.exit_code == 3, out
    assert "1 task(s) run in no docker/podman image" in out
    assert f"{tag} (docker, 2 tasks): built" in out
    assert "polar-base:bookworm (docker, task c): present" in out
    assert "polar-test-absent:1 (docker, task d): missing" in out and "give its tasks a runtime.build" in out
    assert f"{tag}-broken (docker, task e): failed: building {tag}-broken with docker failed (exit 9)" in out
    assert out.rstrip().endswith("4 image(s): 1 built, 1 present, 1 missing, 1 failed")
    first = _image_id(docker_engine, tag)

    again = CliRunner().invoke(main, ["images", "build", str(tasks), "--only", "a", "--only", "c"])
    assert again.exit_code == 0, again.output
    assert f"{tag} (docker, task a): up to date" in again.output
    assert again.output.rstrip().endswith("2 image(s): 1 up to date, 1 present")
    assert _image_id(docker_engine, tag) == first

    forced = CliRunner().invoke(main, ["images", "build", str(tasks), "--only", "a", "--force"])
    assert forced.exit_code == 0 and f"{tag} (docker, task a): built" in forced.output
    assert _image_id(docker_engine, tag) != first
