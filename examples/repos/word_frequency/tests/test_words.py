import unittest

from words import top_words


class TopWordsTest(unittest.TestCase):
    def test_most_frequent_first(self):
        self.assertEqual(top_words("b a b c b a", 2), [("b", 3), ("a", 2)])

    def test_ties_alphabetical(self):
        self.assertEqual(top_words("pear apple fig", 3), [("apple", 1), ("fig", 1), ("pear", 1)])

    def test_case_insensitive(self):
        self.assertEqual(top_words("The the THE end", 1), [("the", 3)])

    def test_n_larger_than_vocabulary(self):
        self.assertEqual(top_words("one", 5), [("one", 1)])


if __name__ == "__main__":
    unittest.main()
