"""Run health: signs that a run is failing in ways the reward hides."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence

from tiller.rollout.trajectory import Status, Trajectory

log = logging.getLogger(__name__)


class EnvErrorTrend:
    """The env_error rate per weight version (the version that sampled each episode's first
    turn), and a warning when it rises during training: a policy may be learning to break its
    environment (env_error episodes escape the policy's penalty).

    Rising means: the rate over the last `window` versions exceeds the rate over the first
    `window` versions by more than `margin` (absolute). It warns once, and reports
    `env_error_rising` = 1 in the metrics from then on.
    """

    def __init__(self, window: int = 3, margin: float = 0.05):
        self.window, self.margin = window, margin
        self.counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # version -> [err, n]
        self.rising = False

    def by_version(self) -> dict[int, float]:
        return {v: err / n for v, (err, n) in sorted(self.counts.items())}

    def update(self, trajectories: Sequence[Trajectory], version: int) -> dict[str, float]:
        """Count `trajectories`; one that generated nothing (its reset failed) counts under
        `version`, the weights current when it ran."""
        for t in trajectories:
            c = self.counts[t.versions[0] if t.versions else version]
            c[0] += t.status is Status.ENV_ERROR
            c[1] += 1
        versions = sorted(self.counts)
        if len(versions) < 2 * self.window:
            return {"env_error_rising": float(self.rising)}

        def rate(vs: list[int]) -> float:
            err = sum(self.counts[v][0] for v in vs)
            return err / max(sum(self.counts[v][1] for v in vs), 1)

        first, last = rate(versions[: self.window]), rate(versions[-self.window :])
        if last > first + self.margin and not self.rising:
            self.rising = True
            log.warning("env_error rate rose from %.3f (first %d weight versions) to %.3f "
                        "(last %d): the policy may be learning to break its environment",
                        first, self.window, last, self.window)
        return {"env_error_rising": float(self.rising), "env_error_rate_first": first,
                "env_error_rate_recent": last}


class JudgeHackingTrend:
    """Judge reward rising while verifier success does not: the policy may be learning to
    please the judge (rl.judge) instead of answering better.

    Each RL step adds (judge mean, success rate) of its ended episodes. Once 2 * `window`
    steps are in, the last `window` steps are compared with the `window` before them: when
    the judge mean rose by more than `margin` and the success rate by no more than `margin`
    (noise), hacking is suspected. A drift slower than `margin` per `window` steps is not
    seen: a larger window catches slower ones. `judge/hacking_suspected` is 1 on those steps
    (0 otherwise) and each new suspicion logs a warning and counts in
    `judge/hacking_warnings`.
    """

    def __init__(self, window: int = 3, margin: float = 0.05):
        self.window, self.margin = window, margin
        self.history: list[tuple[float, float]] = []  # (judge mean, success rate) per step
        self.suspected = False
        self.warnings = 0

    def update(self, judge_mean: float, success: float) -> dict[str, float]:
        self.history.append((judge_mean, success))
        w = self.window
        if len(self.history) < 2 * w:
            return {"judge/hacking_suspected": 0.0, "judge/hacking_warnings": 0.0}
        before, last = self.history[-2 * w: -w], self.history[-w:]

        def mean(rows: list[tuple[float, float]], i: int) -> float:
            return sum(r[i] for r in rows) / len(rows)

        judge_rise = mean(last, 0) - mean(before, 0)
        success_rise = mean(last, 1) - mean(before, 1)
        suspected = judge_rise > self.margin and success_rise <= self.margin
        if suspected and not self.suspected:
            self.warnings += 1
            log.warning("judge reward rose by %.3f over the last %d steps while verifier "
                        "success changed by %+.3f: the policy may be gaming the judge "
                        "(rl.judge.fn)", judge_rise, w, success_rise)
        self.suspected = suspected
        return {"judge/hacking_suspected": float(suspected),
                "judge/hacking_warnings": float(self.warnings), "judge/rise": judge_rise,
                "judge/success_rise": success_rise}
