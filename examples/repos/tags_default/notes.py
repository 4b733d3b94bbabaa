"""Notes with tags."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Note:
    text: str
    tags: list[str] = field(default_factory=list)


def make_note(text: str, tags: list[str] = []) -> Note:
    """A new note; `tags` (default: none) are lower-cased and de-duplicated, in first-seen order."""
    for tag in list(tags):
        tags.remove(tag)
        if tag.lower() not in tags:
            tags.append(tag.lower())
    return Note(text, tags)
