"""Seeds derived from names, the same in every process (imports nothing heavy, so the trace
readers can use it without torch)."""

from __future__ import annotations

import hashlib
from typing import Any


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1
