import unittest

from stats import moving_average


class MovingAverageTest(unittest.TestCase):
    def test_pairs(self):
        self.assertEqual(moving_average([1, 2, 3, 4], 2), [1.5, 2.5, 3.5])

    def test_window_equals_length(self):
        self.assertEqual(moving_average([2, 4, 6], 3), [4.0])

    def test_window_of_one_is_identity(self):
        self.assertEqual(moving_average([5, 7], 1), [5.0, 7.0])

    def test_window_longer_than_values(self):
        self.assertEqual(moving_average([1, 2], 3), [])

    def test_rejects_non_positive_window(self):
        with self.assertRaises(ValueError):
            moving_average([1, 2], 0)


if __name__ == "__main__":
    unittest.main()
