"""A task file's `agent.skills[].path`: a skill read from the file's folder into the task, as text.

A task travels to a rollout server and its nodes as JSON, so a skill is sent inline (`content`, `files`).
Written by hand, a skill is a folder (SKILL.md and what it refers to); a task file may name it by `path`,
relative to the task file and confined to its folder as an upload source is (`polar.rollout.uploads`):
a SKILL.md alone, or a folder holding one, whose other files become the skill's `files`. The name defaults
to the folder's, as the Agent Skills layout has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polar.rollout.uploads import confine_upload
from polar.task import SKILL_FILE

# A skill is sent with every task that names it: a folder beyond this is a mistake (a `path: .`).
MAX_SKILL_BYTES = 1 << 20


class SkillPathError(ValueError):
    """A `path` that cannot be read, with the index of its skill in `agent.skills`."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


def inline_skill_paths(item: Any, base: Path) -> Any:
    """`item` (a task as loaded from the file) with each `agent.skills[i].path` replaced by the skill's
    `content` and `files` read under `base`; anything else is left to the task's validation."""
    agent = item.get("agent") if isinstance(item, dict) else None
    if not isinstance(agent, dict):
        return item
    skills = agent.get("skills")
    if not isinstance(skills, list) or not any(isinstance(s, dict) and "path" in s for s in skills):
        return item
    read = [_read(s, i, base) if isinstance(s, dict) and "path" in s else s for i, s in enumerate(skills)]
    return {**item, "agent": {**agent, "skills": read}}


def _read(skill: dict[str, Any], index: int, base: Path) -> dict[str, Any]:
    path = skill["path"]
    taken = sorted({"content", "files"} & set(skill))
    if taken:
        raise SkillPathError(index, f"give `path` or `{taken[0]}`, not both (`path` is read into them)")
    if not isinstance(path, str) or not path:
        raise SkillPathError(index, f"must be a path relative to {base}, not {path!r}")
    if Path(path).is_absolute():
        raise SkillPathError(index, f"{path!r} is absolute; write it relative to {base}")
    try:
        where = confine_upload(base / path, (base,))
    except ValueError:
        raise SkillPathError(index, f"{path!r} leads outside {base} (to {(base / path).resolve()})") from None
    if where.is_dir():
        folder, main = where, where / SKILL_FILE
        if not main.is_file():
            raise SkillPathError(index, f"{path!r} holds no {SKILL_FILE}")
    elif where.is_file():
        folder, main = where.parent, where
    else:
        raise SkillPathError(index, f"{path!r}: no such file or folder in {base}")
    files = _files(folder, base, index) if where.is_dir() else {}
    out = {k: v for k, v in skill.items() if k != "path"}
    out.setdefault("name", folder.name)
    return {**out, "content": _text(main, index), "files": files}


def _files(folder: Path, base: Path, index: int) -> dict[str, str]:
    """Every other file under `folder` (hidden ones too, but no `.git`), by path relative to it."""
    out: dict[str, str] = {}
    total = 0
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if ".git" in rel.parts or path.is_dir() or rel.as_posix() == SKILL_FILE:
            continue
        try:
            confine_upload(path, (base,))
        except ValueError:
            raise SkillPathError(
                index, f"{rel} leads outside {base} (a symlink to {path.resolve()})"
            ) from None
        out[rel.as_posix()] = text = _text(path, index)
        total += len(text.encode())
        if total > MAX_SKILL_BYTES:
            raise SkillPathError(
                index, f"{folder} holds more than {MAX_SKILL_BYTES >> 20} MiB; a skill is sent inline"
            )
    return out


def _text(path: Path, index: int) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SkillPathError(index, f"{path} is not UTF-8 text (a skill's files are sent as text)") from None
    except OSError as exc:
        raise SkillPathError(index, f"{path}: cannot read: {exc.strerror}") from None
