def count_words(text):
    """How many whitespace-separated words `text` holds."""
    return len(text.split(" "))
