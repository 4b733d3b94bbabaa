"""`python -m polar.docs [--check] [--out DIR]`: write docs/reference, or check it is up to date."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from polar.docs import REFERENCE, stale, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polar.docs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from the code")
    parser.add_argument("--out", type=Path, default=REFERENCE, help=f"folder (default {REFERENCE})")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        for name in bad:
            print(f"stale: {args.out / name}", file=sys.stderr)
        if bad:
            print("regenerate with: python -m polar.docs", file=sys.stderr)
        return 1 if bad else 0
    for name in write(args.out):
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
