"""Helpers the CLI presets share: settings checks, config files written into the runtime, artifact copies.

They live outside `polar.harness.presets` because the registry and the docs table treat every module of
that package as a preset. Only what several presets do the same way is here; each preset keeps its own
quirks (its config format, its post-run layout, how it tells side calls from the main loop).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, cast, overload

from polar.harness.base import HarnessContext
from polar.harness.install import npm_bin_async
from polar.harness.shell import instruction_path
from polar.jsontypes import JSON
from polar.runtime.base import Runtime, RuntimeFailure

# Writes stdin to "$1", creating its folder; through exec, so it lands inside whatever sandbox the runtime is.
_WRITE = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
# Copies the listed paths (relative to $HOME) that exist into the artifacts, then counts the files copied.
_COLLECT = (
    'dst="$1"; home="$2"; shift 2; mkdir -p -- "$dst"; cd -- "$home" || exit 1; '
    'for p in "$@"; do [ -e "$p" ] && mkdir -p -- "$dst/$(dirname -- "$p")" '
    '&& cp -r -- "$p" "$dst/$(dirname -- "$p")/"; done; find "$dst" -type f | wc -l'
)


# -- settings ------------------------------------------------------------------------------------------
def refuse_unknown(harness: str, settings: dict[str, Any], known: Iterable[str]) -> None:
    """ValueError listing the settings `harness` does not know (a typo must not be silently ignored)."""
    known = list(known)
    unknown = sorted(set(settings) - set(known))
    if unknown:
        from polar.hints import close_match

        near = close_match(unknown[0], known)
        hint = f" (did you mean {near!r}?)" if near else ""
        raise ValueError(f"{harness} harness: unknown settings {unknown}{hint}; known: {known}")


@overload
def one_of(
    harness: str, name: str, value: JSON, choices: Iterable[str], *, optional: Literal[False] = False
) -> str: ...
@overload
def one_of(harness: str, name: str, value: JSON, choices: Iterable[str], *, optional: bool) -> str | None: ...
def one_of(
    harness: str, name: str, value: JSON, choices: Iterable[str], *, optional: bool = False
) -> str | None:
    """`value` if it is one of `choices`; with `optional`, None (the setting was not given) passes too."""
    choices = list(choices)
    if not (optional and value is None) and value not in choices:
        raise ValueError(f"{harness} harness: settings.{name} must be one of {choices}, not {value!r}")
    return cast("str | None", value)  # one of `choices`, or None


def positive_int(harness: str, name: str, value: JSON) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{harness} harness: settings.{name} must be a positive integer, not {value!r}")
    return value


def optional_positive_int(harness: str, name: str, value: JSON) -> int | None:
    return None if value is None else positive_int(harness, name, value)


def count(harness: str, name: str, value: JSON) -> int:
    """An integer >= 0 (retries, step limits)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{harness} harness: settings.{name} must be an integer >= 0, not {value!r}")
    return value


def optional_count(harness: str, name: str, value: JSON) -> int | None:
    return None if value is None else count(harness, name, value)


def absolute_binary(harness: str, value: JSON) -> str | None:
    """`settings.binary`: an installed CLI to run instead of the pinned package, by absolute path."""
    if value is not None and (not isinstance(value, str) or not value.startswith("/")):
        raise ValueError(f"{harness} harness: settings.binary must be an absolute path, not {value!r}")
    return value


def extra_args_and_config(harness: str, settings: dict[str, Any] | None) -> tuple[list[str], dict[str, Any]]:
    """(extra_args, config) for presets whose only settings are extra CLI flags and a config overlay."""
    settings = dict(settings or {})
    refuse_unknown(harness, settings, ("extra_args", "config"))
    extra = settings.get("extra_args", [])
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ValueError(f"{harness} harness: settings.extra_args must be a list of strings, not {extra!r}")
    config = settings.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f"{harness} harness: settings.config must be a mapping, not {config!r}")
    return list(extra), dict(config)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into `base` mapping by mapping; any other value in `over` replaces the base's."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = deep_merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return out


# -- the pinned program ----------------------------------------------------------------------------------
async def node_cli(runtime: Runtime, harness: str, package: str, version: str, binary: str) -> str:
    """The pinned npm CLI `binary`, whose entry point is a `#!/usr/bin/env node` script: installed in the
    node's tool cache, and `node` found in the runtime (a container image has its own, or none)."""
    path = str(await npm_bin_async(package, version, binary))
    found = await runtime.exec(["sh", "-c", "command -v node"], timeout_s=60)
    if found.exit_code != 0:
        raise RuntimeFailure(
            f"{harness} harness: {package}@{version} starts through a node script, but the runtime has no "
            "`node` on its PATH (a container image needs Node.js, e.g. Debian's nodejs package: "
            "`polar images base --include bash,ca-certificates,git,patch,procps,python3,nodejs`)"
        )
    return path


# -- Python CLIs from a pip prefix ---------------------------------------------------------------------
def pip_cli_env(prefix: Path | None) -> dict[str, str]:
    """The environment a Python CLI installed into a pip `--target` prefix (`install.pip_prefix`) runs
    with: that prefix first on PYTHONPATH (its pinned dependencies shadow the node's), no user site,
    unbuffered output, and LiteLLM's and the Hugging Face hub's downloads off (LiteLLM fetches its price
    list from GitHub at import; both CLIs using it would otherwise reach past the gateway)."""
    return {
        "PYTHONPATH": str(prefix) if prefix is not None else "",
        "PYTHONUNBUFFERED": "1",
        "PYTHONNOUSERSITE": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "HF_HUB_OFFLINE": "1",
    }


# -- paths and files in the runtime --------------------------------------------------------------------
def under(folder: str, relative: str) -> str:
    """`relative` inside `folder` (a runtime path such as `ctx.home` or `ctx.artifacts`)."""
    return f"{folder.rstrip('/')}/{relative}"


async def write_file(runtime: Runtime, path: str, text: str | bytes) -> None:
    """Write `text` at `path` inside the runtime, or RuntimeFailure naming the file."""
    data = text.encode() if isinstance(text, str) else text
    result = await runtime.exec(["sh", "-c", _WRITE, "sh", path], stdin=data, timeout_s=60)
    if result.exit_code != 0:
        raise RuntimeFailure(f"could not write {path}: {result.stderr.strip()}")


async def write_json(runtime: Runtime, path: str, data: dict[str, Any]) -> None:
    await write_file(runtime, path, json.dumps(data, indent=2))


def stdin_from_instruction(argv: list[str], ctx: HarnessContext) -> str:
    """A shell line running `argv` with the instruction file (`shell.write_instruction`) on stdin: for CLIs
    that would read an instruction starting with "-" or "@" as a flag or a file to attach."""
    return f"{shlex.join(argv)} < {shlex.quote(instruction_path(ctx))}"


async def collect(runtime: Runtime, ctx: HarnessContext, into: str, paths: list[str]) -> dict[str, Any]:
    """Copy the CLI's own transcripts/logs (paths relative to its home) into `artifacts/<into>`."""
    dst = under(ctx.artifacts, into)
    result = await runtime.exec(["sh", "-c", _COLLECT, "sh", dst, ctx.home, *paths], timeout_s=120)
    count = result.stdout.strip()
    if result.exit_code != 0 or not count.isdigit():
        return {"transcript_files": 0, "collect_error": result.stderr.strip()[-500:]}
    return {"transcript_files": int(count)}


# -- reading captured requests -------------------------------------------------------------------------
def texts(content: JSON) -> list[str]:
    """The text of a message content or system field: a string, or the `text` of each block that has one."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []
