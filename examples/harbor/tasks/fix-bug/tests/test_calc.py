"""The hidden test of /app/calc.py; exits 0 when every check passes."""
import sys

sys.path.insert(0, "/app")
import calc  # noqa: E402

assert calc.add(2, 3) == 5, calc.add(2, 3)
assert calc.add(-4, 4) == 0
assert calc.twice(21) == 42
print("all passed")
