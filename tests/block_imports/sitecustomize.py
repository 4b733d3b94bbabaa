"""Makes the packages named in $POLAR_BLOCK_IMPORTS (comma-separated) impossible to import, as in an
environment where they are not installed. Tests put this folder first on PYTHONPATH of a `polar`
subprocess: Python imports `sitecustomize` at start-up, so the product code runs unchanged."""

import os
import sys

BLOCKED = {name for name in os.environ.get("POLAR_BLOCK_IMPORTS", "").split(",") if name}


class _Blocker:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, _Blocker())  # type: ignore[arg-type]
