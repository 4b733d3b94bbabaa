from textstats import mean_word_length, word_count


def test_word_count_simple():
    assert word_count("the quick brown fox") == 4


def test_mean_word_length():
    assert mean_word_length("ab abcd") == 3.0
