"""The data buffer: groups trajectories by task and keeps a ledger of what became of each.

Every trajectory that enters ends trained, filtered (with a reason) or dropped (with a reason);
the ledger's counts go to the metrics, so nothing is lost silently.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

import torch

from tiller.rollout.trajectory import Status, Trajectory


class DataBuffer:
    """`keep_env_errors` keeps env_error trajectories (to be trained at a reduced weight)
    instead of dropping them; aborted ones are always dropped."""

    def __init__(self, keep_env_errors: bool = False) -> None:
        self.groups: dict[str, list[Trajectory]] = defaultdict(list)
        self.ledger: Counter[str] = Counter()
        self.keep_env_errors = keep_env_errors

    def add(self, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            env_failed = t.status is Status.ENV_ERROR and not self.keep_env_errors
            if env_failed or t.status is Status.ABORTED:
                # the environment or engine failed: not evidence about the policy
                self.ledger[f"dropped/{t.status.value}"] += 1
                continue
            self.groups[t.task_id].append(t)

    def zero_variance_groups(self, reward: Callable[[Trajectory], float]) -> list[str]:
        """Task ids of the buffered groups whose rewards are all equal (a group of one too):
        a group baseline gives them A = 0, so they carry no gradient."""
        return [task for task, members in self.groups.items()
                if len({reward(t) for t in members}) <= 1]

    def drop_groups(self, tasks: Iterable[str], reason: str) -> int:
        """Remove whole groups, counted in the ledger as `filtered/<reason>`; returns how many
        trajectories went."""
        gone = 0
        for task in tasks:
            gone += len(self.groups.pop(task))
        self.ledger[f"filtered/{reason}"] += gone
        return gone

    def take_batch(self) -> tuple[list[Trajectory], torch.Tensor]:
        """All buffered groups as one batch, with each trajectory's group index."""
        trajectories: list[Trajectory] = []
        group_index: list[int] = []
        for g, members in enumerate(self.groups.values()):
            trajectories += members
            group_index += [g] * len(members)
        self.ledger["trained"] += len(trajectories)
        self.groups.clear()
        return trajectories, torch.tensor(group_index, dtype=torch.long)
