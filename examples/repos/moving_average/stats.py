"""Small statistics helpers."""


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of every run of `window` consecutive values, in order.

    moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]
    """
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    for start in range(len(values) - window):
        chunk = values[start : start + window]
        out.append(sum(chunk) / window)
    return out
