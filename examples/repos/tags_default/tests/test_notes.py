import unittest

from notes import make_note


class MakeNoteTest(unittest.TestCase):
    def test_tags_normalised(self):
        note = make_note("a", ["Work", "work", "Home"])
        self.assertEqual(note.tags, ["work", "home"])

    def test_default_tags_are_empty(self):
        first = make_note("first")
        first.tags.append("oops")
        second = make_note("second")
        self.assertEqual(second.tags, [])

    def test_caller_list_untouched(self):
        given = ["B", "a"]
        note = make_note("x", given)
        self.assertEqual(given, ["B", "a"])
        self.assertEqual(note.tags, ["b", "a"])


if __name__ == "__main__":
    unittest.main()
