"""What the trainer sees of the rollout side: the `Rollouts` protocol and the plain data that
crosses it (a step's batch, what the end of RL left, the wind-down's time budget). Everything
here is plain data, so another transport can put the producer in its own process or Ray actor;
`manager.RolloutManager` is the in-process one."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from tiller.rollout.trajectory import Trajectory


@dataclass(frozen=True)
class WindDown:
    """The end of RL's time budget, derived here and only here from
    rollout.shutdown_timeout_s (`window`):

        aborting the live requests and waiting for the episodes   share `window`
        cancelling what is still running, and its unwinding       at most `grace`
        close() waits for all of it                               `allowance` = window + grace
                                                                  + `margin`

    so the wind-down always ends inside close's allowance: close raises only if the rollout
    thread itself is stuck (e.g. an episode blocking the event loop)."""

    window: float
    grace: float = 10.0  # cancelled tasks only need to reach their next await
    margin: float = 5.0  # the hand-offs between threads

    @property
    def allowance(self) -> float:
        return self.window + self.grace + self.margin


@dataclass
class Taken:
    """One step's batch and what happened since the last one."""

    trajectories: list[Trajectory]  # the batch, in launch order
    group_index: list[int]
    ended: list[Trajectory]  # every episode that ended since the last batch (for metrics)
    stats: dict[str, float]


@dataclass
class Leftovers:
    """What the end of RL left (`Rollouts.leftovers`); none of it was trained."""

    ended: list[Trajectory]  # ended after the last batch was taken: in no `Taken.ended`
    # those RL's end left untrained, the ledger's dropped/in_flight_at_end and
    # dropped/unused_at_end (a group that waited for a step may have ended long before)
    at_end: list[Trajectory]


class Rollouts(Protocol):
    """The trainer's view of the rollout side."""

    ledger: Counter[str]  # what became of every trajectory started so far

    def next_batch(self, step: int) -> Taken:
        """Step `step`'s groups (none when every group was dropped or filtered); waits at
        most rollout.batch_timeout_s."""
        ...

    def weights_live(self, steps_trained: int, version: int) -> None:
        """The engine now serves `version`, after `steps_trained` RL steps."""
        ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> Counter[str]:
        """Stop producing, account for every episode still running; returns the ledger."""
        ...

    def leftovers(self) -> Leftovers:
        """After `close`: what the end of RL left untrained."""
        ...
