def add(a, b):
    """The sum of a and b."""
    return a - b


def twice(x):
    """x added to itself."""
    return add(x, x)
