"""Roman numerals."""

_NUMERALS = [
    (1000, "M"),
    (500, "D"),
    (100, "C"),
    (50, "L"),
    (10, "X"),
    (5, "V"),
    (1, "I"),
]


def to_roman(number: int) -> str:
    """`number` (1..3999) in Roman numerals, using subtractive notation: 4 is IV, 9 is IX, 40 is XL."""
    if not 1 <= number <= 3999:
        raise ValueError("number must be between 1 and 3999")
    out = []
    for value, letters in _NUMERALS:
        while number >= value:
            out.append(letters)
            number -= value
    return "".join(out)
