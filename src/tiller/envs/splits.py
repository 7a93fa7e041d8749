"""Train / held-out splits by hash, so the two splits never share a task instance.

An instance's split is a pure function of its identity (a string key that says what the task
*is*, e.g. the arithmetic of a word problem or the spec of a function), not of the seed or
the order it was drawn in. Drawing from either split with any seed therefore never produces
an instance of the other, and held-out numbers stay honest however many tasks are drawn.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable
from typing import TypeVar

from tiller.errors import ConfigError

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


class Patience:
    """Stops a draw loop, with one line, once the draws stop finding new instances.

    It fails when the draws since the last new instance outnumber both `min_draws` and twice
    all the draws before it. When a split's N instances are drawn uniformly, finding them all
    takes about N·ln N draws and the wait for the last one about N, so a space that still
    holds a new instance almost never trips it (P ≈ exp(-2 ln N) = N^-2), while a used-up one
    trips it after max(min_draws, 2×) more draws than it took to use it up: seconds, not
    minutes.
    """

    def __init__(self, split: str, n: int, min_draws: int = 1000):
        self.split, self.n, self.min_draws = split, n, min_draws
        self.draws = self.found = self.last_new = 0

    def record(self, new: bool) -> None:
        """Count one draw (`new`: it found an instance not seen before)."""
        self.draws += 1
        if new:
            self.found, self.last_new = self.found + 1, self.draws
        elif self.draws - self.last_new > max(self.min_draws, 2 * self.last_new):
            raise ConfigError(
                f"only {self.found} distinct {self.split} tasks exist ({self.draws} draws "
                f"found no more), {self.n} requested: ask for fewer tasks or a larger task "
                "space (e.g. a higher env.difficulty)"
            )


def split_size(space: Iterable[str] | int, split: str, heldout_fraction: float = 0.2) -> int:
    """How many instances of a task space fall in `split`: counted exactly from the keys of all
    of them, or, given only the size of a space too big to list, its expected hash share."""
    check_split(split)
    if isinstance(space, int):
        share = heldout_fraction if split == "heldout" else 1.0 - heldout_fraction
        return int(space * share)
    return sum(split_of(k, heldout_fraction) == split for k in space)


def draw_split(
    split: str,
    n: int,
    rng: random.Random,
    draw: Callable[[random.Random], T],
    key: Callable[[T], str],
    heldout_fraction: float = 0.2,
) -> list[T]:
    """`n` distinct instances of `split`, drawn with `draw(rng)` and identified by `key`.

    Raises a one-line `ConfigError` instead of drawing on when the instance space is too small
    for `n` (see `Patience`).
    """
    check_split(split)
    found: dict[str, T] = {}
    patience = Patience(split, n)
    while len(found) < n:
        item = draw(rng)
        k = key(item)
        new = k not in found and split_of(k, heldout_fraction) == split
        if new:
            found[k] = item
        patience.record(new)
    return list(found.values())
