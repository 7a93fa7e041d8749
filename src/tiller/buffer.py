"""The data buffer: groups trajectories by task and keeps a ledger of what became of each.

Every trajectory that enters ends trained, filtered (with a reason) or dropped (with a reason);
the ledger's counts go to the metrics, so nothing is lost silently.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator

import torch

from tiller.config import DynamicSamplingConfig
from tiller.envs.base import Task
from tiller.rollout.trajectory import Status, Trajectory


class DataBuffer:
    """`keep_env_errors` keeps env_error trajectories (to be trained at a reduced weight)
    instead of dropping them; aborted ones are always dropped, and so are trajectories with no
    generated token (nothing to train on)."""

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
            elif t.num_generated == 0:  # e.g. a kept env_error whose reset failed
                self.ledger["dropped/empty"] += 1
            else:
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


def fill_groups(buffer: DataBuffer, rollout: Callable[[list[Task], tuple], list[Trajectory]],
                tasks: Iterator[Task], want: int, dynamic: DynamicSamplingConfig,
                reward: Callable[[Trajectory], float], step: int
                ) -> tuple[list[Trajectory], dict[str, float]]:
    """Roll out one step's groups into the buffer: `want` tasks, `rollout(tasks, tag)` each.

    With dynamic sampling, groups whose training rewards are all equal are filtered out
    (ledger: `filtered/zero_variance`) and the missing number of groups is sampled again,
    until `want` groups have signal or `max_rounds` rounds ran; then the step trains on what
    there is. Without it, such groups stay in the batch (A = 0) and are only counted. Returns
    every trajectory sampled, for the rollout metrics, and the counts.
    """
    sampled: list[Trajectory] = []
    groups = flat = rounds = 0
    for r in range((dynamic.max_rounds or 1) if dynamic.enabled else 1):
        batch_tasks = list(itertools.islice(tasks, want - len(buffer.groups)))
        if not batch_tasks:
            break
        trajs = rollout(batch_tasks, ("rl", step) if r == 0 else ("rl", step, r))
        sampled += trajs
        rounds += 1
        before = len(buffer.groups)
        buffer.add(trajs)
        groups += len(buffer.groups) - before
        zero = buffer.zero_variance_groups(reward)  # earlier rounds' flat groups were dropped
        flat += len(zero)
        if dynamic.enabled:
            buffer.drop_groups(zero, "zero_variance")
    stats = {"zero_variance_group_frac": flat / max(groups, 1),
             "groups_kept": float(len(buffer.groups)),
             "rollout_tokens": float(sum(t.num_generated for t in sampled))}
    if dynamic.enabled:
        stats.update(sampling_rounds=float(rounds), groups_dropped=float(flat))
    return sampled, stats
