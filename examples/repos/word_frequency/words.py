"""Word frequencies."""

import re
from collections import Counter


def top_words(text: str, n: int) -> list[tuple[str, int]]:
    """The `n` most frequent words of `text` (case-insensitive) with their counts, most frequent first;
    words with equal counts in alphabetical order."""
    counts = Counter(re.findall(r"[a-z']+", text.lower()))
    ranked = sorted(counts.items(), key=lambda item: (item[1], item[0]))
    return ranked[:n]
