"""Verifiers: pure functions from an episode's outcome to a `Reward`.

A reward is gated, not summed: the default shape is 1 when every necessary check passes and 0
otherwise, with each check kept in `checks` so a learning curve can be explained. `env_error`
marks an episode the environment broke, which is not the policy's failure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Reward:
    value: float
    checks: Mapping[str, float] = field(default_factory=dict)
    turn_rewards: tuple[float, ...] | None = None
    env_error: bool = False


def all_of(**checks: bool) -> Reward:
    """1.0 only if every named check passes; the breakdown keeps each one."""
    breakdown = {k: float(v) for k, v in checks.items()}
    return Reward(value=float(all(checks.values())), checks=breakdown)
