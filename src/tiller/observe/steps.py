"""The record of RL, step by step: each step's metrics (one `rl` row in metrics.jsonl), the
trace writes (every ended episode, each trained batch, the ledger, what the end left), the
progress bar, and the RL summary (`rl_summary`). `tiller.controller.rl` calls a
`StepRecorder` at each stage of a step; nothing here decides what is trained."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tiller.observe.health import EnvErrorTrend, JudgeHackingTrend
from tiller.observe.metrics import progress
from tiller.observe.traces import TraceWriter
from tiller.rollout.collect import rollout_metrics
from tiller.rollout.protocol import Rollouts, Taken
from tiller.train.batch import Batch
from tiller.train.shaping import judge_metrics
from tiller.train.trainer import PolicyTrainer

log = logging.getLogger(__name__)

Stats = Callable[[], dict[str, float]]


NUMBER = (int, float)
# `StepRecorder.state`'s lists of pairs: the types of each pair's two items
RECORDER_PAIRS = {"staleness": (int, int), "env_errors": (int, list),
                  "judge_history": (NUMBER, NUMBER)}
RECORDER_SCALARS = {"env_error_rising": bool, "trainer_s": NUMBER, "judge_suspected": bool,
                    "judge_warnings": int}


def check_recorder_state(state: Any) -> None:
    """`state` (a checkpoint's, as `StepRecorder.state` gave it, read back from JSON) of the
    shape `StepRecorder.load_state` reads: a KeyError or TypeError naming the first field that
    is not."""
    if not isinstance(state, dict):
        raise TypeError(f"the recorder's state is a {type(state).__name__}, not an object")
    for key, (first, second) in RECORDER_PAIRS.items():
        rows = state[key]
        if not (isinstance(rows, list) and all(
                isinstance(r, list) and len(r) == 2 and isinstance(r[0], first)
                and isinstance(r[1], second) for r in rows)):
            raise TypeError(f"the recorder's {key} is not a list of pairs")
    if not all(len(c) == 2 and all(type(n) is int for n in c) for _, c in state["env_errors"]):
        raise TypeError("the recorder's env_errors holds counts that are not two ints")
    for key, kind in RECORDER_SCALARS.items():
        if not isinstance(state[key], kind):
            raise TypeError(f"the recorder's {key} is a {type(state[key]).__name__}")


class StepRecorder:
    """Per-step metrics, trace writes and progress of one RL run, and its summary.

    A step is recorded as `begin` (its clock starts), `taken` (the batch and the episodes
    that ended since the last step), `trained` and `pushed` (on a step that trained), `end`
    (the counters as of this step) and `log`. `log_fn(phase, metrics, step)` writes a row,
    `tools` returns (and resets) the tool counters, `engine` the engine's, and each of
    `others` more counters for the row (the gateway's, the curriculum's)."""

    def __init__(self, log_fn: Callable[..., None], traces: TraceWriter | None,
                 trainer: PolicyTrainer, *, tools: Stats, engine: Stats,
                 others: Sequence[Stats] = (),
                 judge_weight: float = 0.0, hacking: JudgeHackingTrend | None = None):
        self._log, self.traces, self._trainer = log_fn, traces, trainer
        self._tools, self._engine, self._others = tools, engine, others
        self._judge_weight, self._hacking = judge_weight, hacking or JudgeHackingTrend()
        self.trend = EnvErrorTrend()
        self.staleness: Counter[int] = Counter()  # trajectories trained, by staleness
        self.trainer_s = 0.0  # training and pushing, summed over the steps
        self.step = 1  # the step RL is in (1-based): where what is left at the end is traced
        self.metrics: dict[str, Any] = {}
        self._taken = Taken([], [], [], {})
        self._engine_busy0 = engine().get("busy_s")
        self._t0 = self._t_end = self._ts = self._tt = self._ts_sync = time.perf_counter()
        self._taken_version = trainer.version
        self._advance: Callable[[str], None] = lambda info: None

    @contextmanager
    def running(self, rollouts: Rollouts, title: str, steps: int,
                show: bool = True) -> Iterator[None]:
        """The steps, under a progress bar (`show`). When they raise, the rollouts are wound
        down and the final ledger is logged (`rl_summary`) before the error goes on: the
        error that stopped RL is the one to report, not a failing wind-down's."""
        try:
            with progress(show, title, steps) as self._advance:
                yield
            self._t_end = time.perf_counter()
        except BaseException:
            try:
                self._log("rl_summary", ledger_row(self.wind_down(rollouts)))
            except Exception as e:
                log.error("rl: winding down the rollouts after the error below failed too: "
                          "%s: %s", type(e).__name__, e)
            raise

    def begin(self, step: int) -> None:
        """Step `step` (0-based, as the trainer counts) starts: its clock and its row."""
        self.step, self.metrics = step + 1, {}
        self._ts = time.perf_counter()

    def taken(self, taken: Taken) -> Taken:
        """The step's batch: the episodes that ended since the last step (in async, when none
        did, as the producer stops at the end of the run: the batch's own), each traced, their
        env errors by version, and the judge's figures and hacking trend."""
        version = self._taken_version = self._trainer.version
        ended = taken.ended
        self.metrics = m = {**taken.stats, **rollout_metrics(ended or taken.trajectories),
                            **self.trend.update(ended, version),
                            "rollout_tokens": float(sum(t.num_generated for t in ended)),
                            "rollout_s": time.perf_counter() - self._ts}  # the wait for it
        if self.traces is not None:
            for t in ended:
                self.traces.put_episode(t, "rl", "train", version, self.step)
        judge = judge_metrics(ended, self._judge_weight)
        if judge:
            m.update(judge, **self._hacking.update(judge["judge/mean"], m["success_rate"]))
        self._taken, self._tt = taken, time.perf_counter()
        return taken

    def trained(self, batch: Batch, *parts: dict[str, float]) -> None:
        """The batch trained: its staleness, then `parts` (what shaping and the trainer
        report) and `train_s`; the batch traced."""
        kept = self._taken.trajectories
        stale = [self._taken_version - min(t.versions) for t in kept]
        self.staleness.update(stale)
        self.metrics.update(staleness_metrics(stale))
        for part in parts:
            self.metrics.update(part)
        self.metrics["train_s"] = time.perf_counter() - self._tt
        if self.traces is not None:
            self.traces.put_training(self.step, kept, batch, self._trainer.last_rl)
        self._ts_sync = time.perf_counter()

    def pushed(self, sync: dict[str, float]) -> None:
        """The new weights are on the engine: the sync/* metrics (bytes, kind, parity)."""
        self.metrics.update(sync)
        self.metrics["sync_s"] = time.perf_counter() - self._ts_sync
        self.trainer_s += time.perf_counter() - self._tt

    def end(self, rollouts: Rollouts) -> None:
        """The rest of the row: tool counters, times, and the ledger, engine, gateway and
        curriculum counters as of this step, before the next groups may start (in sync they
        start only after the step, so these are exact per step)."""
        m = self.metrics
        m.update(self._tools(), step_s=time.perf_counter() - self._ts,
                 version=self._trainer.version, skipped=float(not self._taken.trajectories),
                 trainer_busy_frac=self.trainer_s / (time.perf_counter() - self._t0))
        ledger = {k: v for k, v in rollouts.stats().items() if k.startswith("ledger/")}
        m.update(ledger)
        if self.traces is not None:
            self.traces.put_ledger(self.step, self._trainer.version,
                                   {k.removeprefix("ledger/"): v for k, v in ledger.items()})
            m.update(self.traces.stats())
        m.update({f"engine/{k}": v for k, v in self._engine().items()})
        for stats in self._others:
            m.update(stats())

    def log(self) -> None:
        """The step's row, at its RL step, and the progress bar moved on."""
        m = self.metrics
        self._log("rl", m, self.step)
        self._advance(f"reward={m['reward_mean']:.2f} success={m['success_rate']:.2f} "
                      f"zero_var={m['zero_variance_group_frac']:.2f}")

    def state(self) -> dict[str, Any]:
        """The counters a resumed run carries on (a checkpoint's, as JSON): trained staleness,
        the env-error and judge-hacking trends, the trainer's time so far."""
        h = self._hacking
        return {"staleness": [[s, n] for s, n in self.staleness.items()],
                "env_errors": [[v, c] for v, c in self.trend.counts.items()],
                "env_error_rising": self.trend.rising, "trainer_s": self.trainer_s,
                "judge_history": h.history, "judge_suspected": h.suspected,
                "judge_warnings": h.warnings}

    def load_state(self, state: dict[str, Any]) -> None:
        """Put back what `state` returned (`check_recorder_state` checked its shape)."""
        self.staleness.update({s: n for s, n in state["staleness"]})
        self.trend.counts.update({v: list(c) for v, c in state["env_errors"]})
        self.trend.rising, self.trainer_s = state["env_error_rising"], state["trainer_s"]
        h = self._hacking
        h.history = [tuple(r) for r in state["judge_history"]]
        h.suspected, h.warnings = state["judge_suspected"], state["judge_warnings"]

    def wind_down(self, rollouts: Rollouts) -> Counter[str]:
        """Close the rollouts and trace what the end of RL left, under the step RL ended in:
        the episodes that ended after the last batch was taken, and `at_end` on those it left
        untrained (the ledger's dropped/in_flight_at_end, dropped/unused_at_end). Returns the
        final ledger; its dropped/cancelled_at_end are the episodes cancelled while running,
        which have no trajectory to trace."""
        ledger = rollouts.close()
        left = rollouts.leftovers()
        if self.traces is not None:
            for t in left.ended:
                self.traces.put_episode(t, "rl", "train", self._trainer.version, self.step)
            if left.at_end:
                self.traces.put_at_end(self.step, left.at_end)
        if left.at_end or ledger["dropped/cancelled_at_end"]:
            log.warning("rl: the end of RL left %d finished episodes untrained (traced with "
                        "at_end = 1) and cancelled %d running ones (ledger: %s)",
                        len(left.at_end), ledger["dropped/cancelled_at_end"],
                        {k: v for k, v in ledger.items() if k.endswith("_at_end")})
        return ledger

    def finish(self, rollouts: Rollouts, mode: str) -> dict[str, Any]:
        """After the last step: wind the rollouts down, then log (`rl_summary`) and return
        the summary of RL under `mode`. Its wall time includes winding down the episodes
        still running: their cost is real."""
        ledger = self.wind_down(rollouts)
        wall = time.perf_counter() - self._t0
        produced = rollouts.stats()
        summary = {"mode": mode, "ledger": dict(ledger),
                   "env_error_rate_by_version": self.trend.by_version(), "wall_s": wall,
                   "wind_down_s": wall - (self._t_end - self._t0),
                   "groups_ahead_max": produced["groups_ahead_max"],
                   "trainer_busy_frac": self.trainer_s / wall,
                   "rollout_train_ratio": produced["rollout_busy_s"] / max(self.trainer_s, 1e-9),
                   "samples_per_s": ledger["trained"] / wall}
        if self._engine_busy0 is not None:
            summary["engine_busy_frac"] = (self._engine()["busy_s"] - self._engine_busy0) / wall
        if self.staleness:
            summary["staleness_mean"] = (sum(s * n for s, n in self.staleness.items())
                                         / sum(self.staleness.values()))
            summary["staleness_max"] = max(self.staleness)
        unaccounted = ledger_unaccounted(ledger)
        if unaccounted:  # a bug in the accounting itself: say so loudly, keep the results
            log.error("rl: %d started trajectories are not in the ledger (%s)", unaccounted,
                      dict(ledger))
            summary["ledger_unaccounted"] = unaccounted
        self._log("rl_summary", {**{k: v for k, v in summary.items()
                                    if isinstance(v, (int, float)) and not isinstance(v, bool)},
                                 **ledger_row(ledger)})
        return summary


def ledger_row(ledger: Counter[str]) -> dict[str, float]:
    """The ledger as metrics (`ledger/<bucket>`)."""
    return {f"ledger/{k}": float(v) for k, v in ledger.items()}


def staleness_metrics(stale: list[int]) -> dict[str, float]:
    """The batch's staleness (trainer version - oldest sampling version, per trajectory): mean,
    max and the histogram as `staleness/<s>` = share of trajectories."""
    out = {"staleness_mean": sum(stale) / len(stale), "staleness_max": float(max(stale))}
    for s, n in sorted(Counter(stale).items()):
        out[f"staleness/{s}"] = n / len(stale)
    return out


def ledger_unaccounted(ledger: Counter[str]) -> int:
    """Started trajectories that did not end trained, filtered or dropped (0 unless a bug)."""
    ended = sum(n for k, n in ledger.items()
                if k == "trained" or k.startswith(("filtered/", "dropped/")))
    return ledger["started"] - ended
