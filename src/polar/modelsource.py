"""Where a model named on the command line comes from, decided before anything is loaded.

A model is a local folder or `.gguf` file, or a Hugging Face id. A hub id already in the local cache loads
from it without the network when the network cannot be used (`HF_HUB_OFFLINE=1`, or the hub is not
reachable); one that is not cached fails at once with one line saying so, instead of a minute of retried
requests that end in the same error.

    source, local_only = locate_model("Qwen/Qwen3-0.6B")   # ModelNotFound: ... not in the cache ...

Imports no torch (the CLI checks a model before it pays for loading one).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

# A hub id: `name` or `owner/name` (letters, digits, `-`, `_`, `.`), what huggingface_hub accepts.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")
_TRUE = {"1", "on", "yes", "true"}


class ModelNotFound(OSError):
    """The model cannot be found here or fetched now; the message says which and why in one line."""


def _offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's endpoint opens within `timeout_s` (name lookup included)."""
    parts = urlsplit(_endpoint())
    host = parts.hostname or "huggingface.co"
    port = parts.port or (80 if parts.scheme == "http" else 443)

    def connect() -> bool:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(connect).result(timeout=timeout_s + 1)
    except (OSError, concurrent.futures.TimeoutError):
        return False
    finally:
        pool.shutdown(wait=False)


def _cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return False
    found = try_to_load_from_cache(repo_id, "config.json")
    return isinstance(found, str)


def _cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover
        return "the Hugging Face cache"


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", "./", "../", "~", "."))
        or spec.count("/") > 1
        or spec.endswith(".gguf")
        or (os.sep != "/" and os.sep in spec)
    )


def locate_model(spec: str) -> tuple[str, bool]:
    """(`spec`, whether to load it from local files only) for a folder, a file or a hub id that can be
    loaded now; `ModelNotFound` with the reason otherwise (no network requests are retried here)."""
    path = Path(spec).expanduser()
    if path.exists():
        return str(path), True
    if _looks_like_path(spec):
        raise ModelNotFound(f"{spec}: no such file or folder")
    if not _REPO_ID.match(spec) or "--" in spec or ".." in spec:
        raise ModelNotFound(f"{spec!r} is neither a local folder or file nor a Hugging Face model id")
    if _cached(spec):
        return spec, _offline() or not hub_reachable()
    if _offline():
        raise ModelNotFound(
            f"{spec} is not a local folder and not in the Hugging Face cache ({_cache_dir()}), and "
            "HF_HUB_OFFLINE is set: download it first, or pass a local folder"
        )
    if not hub_reachable():
        raise ModelNotFound(
            f"{spec} is not a local folder and not in the Hugging Face cache ({_cache_dir()}), and "
            f"{_endpoint()} cannot be reached to download it: check the network, or pass a local folder"
        )
    return spec, False


def prepare_model(spec: str | None) -> None:
    """Check before anything loads that `spec` (None: the built-in tiny model) can be loaded now
    (`ModelNotFound` otherwise). Where only the cache can serve a hub id, this process then loads from the
    cache alone (`HF_HUB_OFFLINE`), so no later load waits on requests that cannot succeed."""
    if spec is None:
        return
    source, local_only = locate_model(spec)
    if local_only and not Path(source).exists():
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants = sys.modules.get("huggingface_hub.constants")
        if constants is not None:  # read once at import: set where it is read now
            constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]
