"""Write instances.jsonl: SWE-bench-format instances on the small repositories in repos/.

Each instance is a bug in a repository at its base commit (built into the image by images/<repo>/Dockerfile
with a fixed identity and dates, so the hash is known here), the gold `patch` that fixes it, the
`test_patch` that adds the tests proving it (FAIL_TO_PASS) next to those that must keep passing
(PASS_TO_PASS), and the `eval_script` in SWE-bench 5.x's shape, graded with swebench's pytest log parser.
Each instance's `image` names its image and `build` its Dockerfile, which `polar images build` builds.

    python examples/swe/make_instances.py            # rewrite instances.jsonl
    python examples/swe/make_instances.py --check    # exit 1 if it is not what this script writes
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIT_ENV = {
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_SYSTEM": "/dev/null",
}
IDENTITY = ["-c", "user.name=polar", "-c", "user.email=polar@example.invalid"]
TESTS = "tests/test_textstats.py"

# instance id -> (problem statement, {path: fixed text}, {path: text with the new tests}, F2P, P2P)
INSTANCES = {
    "polar-swe__textstats-1": (
        "word_count counts empty words when a text has several spaces in a row, or leading or trailing "
        'spaces: word_count("a  b") is 3, not 2. Words are separated by any run of whitespace.',
        {
            "textstats/__init__.py": '''"""Small text statistics."""


def words(text: str) -> list[str]:
    """The words of `text`, split on runs of whitespace."""
    return text.split()


def word_count(text: str) -> int:
    return len(words(text))


def mean_word_length(text: str) -> float:
    ws = words(text)
    return sum(len(w) for w in ws) / len(ws)
'''
        },
        {
            TESTS: '''from textstats import mean_word_length, word_count


def test_word_count_simple():
    assert word_count("the quick brown fox") == 4


def test_word_count_extra_spaces():
    assert word_count("  the quick   brown fox ") == 4
    assert word_count("one\\ttwo\\nthree") == 3


def test_mean_word_length():
    assert mean_word_length("ab abcd") == 3.0
'''
        },
        [f"{TESTS}::test_word_count_extra_spaces"],
        [f"{TESTS}::test_word_count_simple", f"{TESTS}::test_mean_word_length"],
    ),
    "polar-swe__textstats-2": (
        'mean_word_length counts punctuation as part of a word: mean_word_length("hi, yo!") is 2.5, but '
        "punctuation around a word is not part of it (the answer is 2.0).",
        {
            "textstats/__init__.py": '''"""Small text statistics."""

import string


def words(text: str) -> list[str]:
    """The words of `text`, split on spaces."""
    return text.split(" ")


def word_count(text: str) -> int:
    return len(words(text))


def mean_word_length(text: str) -> float:
    ws = [w.strip(string.punctuation) for w in words(text)]
    return sum(len(w) for w in ws) / len(ws)
'''
        },
        {
            TESTS: '''from textstats import mean_word_length, word_count


def test_word_count_simple():
    assert word_count("the quick brown fox") == 4


def test_mean_word_length():
    assert mean_word_length("ab abcd") == 3.0


def test_mean_word_length_ignores_punctuation():
    assert mean_word_length("hi, yo!") == 2.0
    assert mean_word_length("(ab) 'abcd'") == 3.0
'''
        },
        [f"{TESTS}::test_mean_word_length_ignores_punctuation"],
        [f"{TESTS}::test_word_count_simple", f"{TESTS}::test_mean_word_length"],
    ),
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", *IDENTITY, *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def base_repo(name: str, into: Path) -> str:
    """A copy of repos/NAME committed as the image's Dockerfile commits it; returns the commit hash."""
    shutil.copytree(HERE / "repos" / name, into, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    git(into, "init", "-q", "-b", "main")
    git(into, "add", "-A")
    git(into, "commit", "-qm", "base")
    return git(into, "rev-parse", "HEAD").strip()


def diff_of(repo: Path, files: dict[str, str]) -> str:
    for path, text in files.items():
        (repo / path).write_text(text)
    out = git(repo, "diff", "--no-color", "--no-ext-diff", "--src-prefix=a/", "--dst-prefix=b/")
    git(repo, "checkout", "-q", "--", ".")
    return out


def eval_script(base: str, test_patch: str, tests: list[str]) -> str:
    files = " ".join(tests)
    return "\n".join(
        [
            "#!/bin/bash",
            "set -uxo pipefail",
            "cd /testbed",
            f"git checkout {base} {files}",
            "git apply -v - <<'EOF_114329324912'",
            test_patch.rstrip("\n"),
            "EOF_114329324912",
            ": '>>>>> Start Test Output'",
            f"python3 -m pytest -rA -p no:cacheprovider {files}",
            ": '>>>>> End Test Output'",
            f"git checkout {base} {files}",
            "",
        ]
    )


def instances() -> list[dict[str, object]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "textstats"
        base = base_repo("textstats", repo)
        for iid, (statement, fix, tests, f2p, p2p) in INSTANCES.items():
            test_patch = diff_of(repo, tests)
            out.append(
                {
                    "instance_id": iid,
                    "repo": "polar/textstats",
                    "version": "1.0",
                    "base_commit": base,
                    "problem_statement": statement,
                    "patch": diff_of(repo, fix),
                    "test_patch": test_patch,
                    "FAIL_TO_PASS": f2p,
                    "PASS_TO_PASS": p2p,
                    "image": "polar-swe-textstats:1",
                    # How `polar images build` makes the image: context relative to this folder, the
                    # Dockerfile relative to the context (as runtime.build).
                    "build": {"context": "repos/textstats", "dockerfile": "../../images/textstats/Dockerfile"},
                    "log_parser": "parse_log_pytest",
                    "eval_type": "pass_and_fail",
                    "eval_script": eval_script(base, test_patch, sorted(tests)),
                }
            )
    return out


def main() -> None:
    text = "".join(json.dumps(i, sort_keys=True) + "\n" for i in instances())
    target = HERE / "instances.jsonl"
    if "--check" in sys.argv:
        if not target.is_file() or target.read_text() != text:
            sys.exit(f"{target} is not what {Path(__file__).name} writes: run it")
        return
    target.write_text(text)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
