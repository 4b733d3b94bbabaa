"""Small text statistics."""


def words(text: str) -> list[str]:
    """The words of `text`, split on spaces."""
    return text.split(" ")


def word_count(text: str) -> int:
    return len(words(text))


def mean_word_length(text: str) -> float:
    ws = words(text)
    return sum(len(w) for w in ws) / len(ws)
