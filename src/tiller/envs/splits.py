"""Train / held-out splits by hash, so the two splits never share a task instance.

An instance's split is a pure function of its identity (a string key that says what the task
*is*, e.g. the arithmetic of a word problem or the spec of a function), not of the seed or
the order it was drawn in. Drawing from either split with any seed therefore never produces
an instance of the other, and held-out numbers stay honest however many tasks are drawn.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
SPLITS = ("train", "heldout")


def split_of(key: str, heldout_fraction: float = 0.2) -> str:
    """"heldout" for a stable `heldout_fraction` of all keys, "train" for the rest."""
    digest = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return "heldout" if digest / 0xFFFFFFFF < heldout_fraction else "train"


def stable_id(prefix: str, key: str) -> str:
    """A short task id that is the same in every process (unlike Python's salted hash())."""
    return f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")


def draw_split(
    split: str,
    n: int,
    rng: random.Random,
    draw: Callable[[random.Random], T],
    key: Callable[[T], str],
    heldout_fraction: float = 0.2,
    max_tries_per_task: int = 1000,
) -> list[T]:
    """`n` distinct instances of `split`, drawn with `draw(rng)` and identified by `key`.

    Raises instead of looping forever when the instance space is too small for `n`.
    """
    check_split(split)
    found: dict[str, T] = {}
    tries = 0
    while len(found) < n:
        tries += 1
        if tries > max_tries_per_task * max(n, 1):
            raise ValueError(
                f"only {len(found)} distinct {split} instances found after {tries - 1} draws, "
                f"{n} requested: ask for fewer tasks or raise the difficulty"
            )
        item = draw(rng)
        k = key(item)
        if k not in found and split_of(k, heldout_fraction) == split:
            found[k] = item
    return list(found.values())
