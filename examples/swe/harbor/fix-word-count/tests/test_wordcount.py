import sys

sys.path.insert(0, "/app")

from wordcount import count_words  # noqa: E402


def test_single_spaces():
    assert count_words("one two three") == 3


def test_runs_of_whitespace():
    assert count_words("one  two\n\nthree\tfour ") == 4


def test_empty():
    assert count_words("") == 0
    assert count_words("   ") == 0
