"""The data buffer: finished groups waiting to be trained, and a ledger of what became of every
trajectory.

Every trajectory that starts ends trained, filtered (with a reason) or dropped (with a reason);
the ledger's counts go to the metrics, so nothing is lost silently. The buffer is not
thread-safe: the rollout manager calls it under its own lock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from tiller.rollout.trajectory import Status, Trajectory


@dataclass
class Group:
    """The kept trajectories of one task's group. `key` = (unit, round, index) orders groups
    by launch, so a batch is assembled in the same order whatever finished first."""

    key: tuple[int, int, int]
    task_id: str
    members: list[Trajectory]

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that sampled any token of the group."""
        return min(min(t.versions) for t in self.members)


class DataBuffer:
    """`keep_env_errors` keeps env_error trajectories (to be trained at a reduced weight)
    instead of dropping them; aborted ones are always dropped, and so are trajectories with no
    generated token (nothing to train on)."""

    def __init__(self, keep_env_errors: bool = False) -> None:
        self.ready: list[Group] = []  # in the order they finished
        self.ledger: Counter[str] = Counter()
        self.keep_env_errors = keep_env_errors

    def admit(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """The trajectories fit to train on; the others are counted as `dropped/<why>`."""
        kept = []
        for t in trajectories:
            env_failed = t.status is Status.ENV_ERROR and not self.keep_env_errors
            if env_failed or t.status is Status.ABORTED:
                # the environment or engine failed: not evidence about the policy
                self.ledger[f"dropped/{t.status.value}"] += 1
            elif t.num_generated == 0:  # e.g. a kept env_error whose reset failed
                self.ledger["dropped/empty"] += 1
            else:
                kept.append(t)
        return kept

    def add(self, group: Group) -> None:
        self.ready.append(group)

    def filter(self, group: Group, reason: str) -> None:
        """Count a group's trajectories as `filtered/<reason>` (it is not, or no longer, in
        the buffer)."""
        if group in self.ready:
            self.ready.remove(group)
        self.ledger[f"filtered/{reason}"] += len(group.members)

    def drop_all(self, reason: str) -> int:
        """Count every buffered group as `dropped/<reason>` and empty the buffer."""
        gone = sum(len(g.members) for g in self.ready)
        if gone:
            self.ledger[f"dropped/{reason}"] += gone
        self.ready.clear()
        return gone

    def take(self, groups: list[Group]) -> tuple[list[Trajectory], torch.Tensor]:
        """Remove `groups` and return them as one batch in launch order, with each
        trajectory's group index; counted as `trained`."""
        trajectories: list[Trajectory] = []
        group_index: list[int] = []
        for g, group in enumerate(sorted(groups, key=lambda g: g.key)):
            self.ready.remove(group)
            trajectories += group.members
            group_index += [g] * len(group.members)
        self.ledger["trained"] += len(trajectories)
        return trajectories, torch.tensor(group_index, dtype=torch.long)
