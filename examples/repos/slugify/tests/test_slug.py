import unittest

from slug import slugify


class SlugifyTest(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(slugify("Hello"), "hello")

    def test_words(self):
        self.assertEqual(slugify("Polar Rollout Service"), "polar-rollout-service")

    def test_punctuation_and_spaces_collapse(self):
        self.assertEqual(slugify("  Hello, World!  "), "hello-world")

    def test_digits_kept(self):
        self.assertEqual(slugify("Top 10 -- tips"), "top-10-tips")

    def test_nothing_left(self):
        self.assertEqual(slugify("!!!"), "")


if __name__ == "__main__":
    unittest.main()
