"""The RL loop's parts, one at a time: `observe.steps.StepRecorder` (each step's row and the RL
summary, figures computed by hand) and `controller.IdleSteps` (when a step with nothing to
train is skipped and when it stops the run), over `ScriptedRollouts`, a second implementation
of the `rollout.protocol.Rollouts` protocol that hands out prepared batches; and a real tiny
run whose RL raises mid-way, which still logs its ledger."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
from helpers import tiny_rl

from tiller.config import load_config
from tiller.controller import IdleSteps, rl
from tiller.envs.verifiers import Reward
from tiller.errors import RunError
from tiller.observe.steps import StepRecorder
from tiller.rollout.protocol import Leftovers, Taken
from tiller.rollout.trajectory import Status, Trajectory, TrajectoryBuilder
from tiller.run import Run
from tiller.train.batch import Batch
from tiller.train.trainer import PolicyTrainer


def episode(task: str, version: int, generated: int, value: float,
            status: Status = Status.COMPLETED) -> Trajectory:
    """A one-turn episode: a 3-token prompt, then `generated` tokens sampled by `version`."""
    b = TrajectoryBuilder(task)
    b.append_prompt([1, 2, 3])
    b.append_generated(list(range(10, 10 + generated)), [-0.5] * generated, version)
    return b.finish(Reward(value, {"correct": value}), status)


class ScriptedRollouts:
    """`Rollouts` that hands out `batches` in order; the ledger counts what they hold (every
    episode started, the batch's trained, the rest filtered), and `close` adds `at_close`."""

    def __init__(self, batches: list[Taken], at_close: Counter[str] | None = None,
                 close_error: Exception | None = None):
        self.batches, self.at_close, self.close_error = list(batches), at_close, close_error
        self.ledger: Counter[str] = Counter()
        self.live: list[tuple[int, int]] = []

    def next_batch(self, step: int) -> Taken:
        taken = self.batches.pop(0)
        self.ledger["started"] += len(taken.ended)
        self.ledger["trained"] += len(taken.trajectories)
        self.ledger["filtered/zero_variance"] += len(taken.ended) - len(taken.trajectories)
        return taken

    def weights_live(self, steps_trained: int, version: int) -> None:
        self.live.append((steps_trained, version))

    def stats(self) -> dict[str, float]:
        return {**{f"ledger/{k}": float(v) for k, v in self.ledger.items()},
                "groups_ahead_max": 0.0, "rollout_busy_s": 2.0}

    def close(self) -> Counter[str]:
        if self.close_error is not None:
            raise self.close_error
        self.ledger.update(self.at_close or {})
        return self.ledger

    def leftovers(self) -> Leftovers:
        return Leftovers([], [])


@pytest.fixture()
def trainer(model) -> PolicyTrainer:
    trainer = PolicyTrainer(model)
    trainer.version = 2  # as after two optimizer steps: the batch is sampled by 0, 1 and 2
    return trainer


def recorder(trainer: PolicyTrainer, rows: list) -> StepRecorder:
    tools = iter([{"tool_calls/calculate": 3.0}, {"tool_calls/calculate": 0.0}])
    return StepRecorder(lambda phase, m, step=None: rows.append((phase, dict(m), step)), None,
                        trainer, tools=lambda: next(tools),
                        engine=lambda: {"busy_s": 0.0, "requests": 5.0},
                        others=[lambda: {"curriculum/level": 2.0}])


def test_a_trained_step_and_a_skipped_one_are_recorded_by_hand(trainer):
    kept = [episode("a", 1, 4, 1.0), episode("a", 2, 6, 0.0), episode("b", 0, 2, 1.0),
            episode("b", 2, 4, 0.0)]
    flat = episode("c", 2, 8, 0.0)  # its group was flat: ended, filtered, not trained
    rollouts = ScriptedRollouts([
        Taken(kept, [0, 0, 1, 1], [*kept, flat], {"zero_variance_group_frac": 1 / 3}),
        Taken([], [], [], {"groups_dropped": 1.0, "zero_variance_group_frac": 1.0})])
    rows: list = []
    rec = recorder(trainer, rows)
    with rec.running(rollouts, "RL", 2, show=False):
        rec.begin(0)
        rec.taken(rollouts.next_batch(0))
        rec.trained(Batch.collate(kept, 0), {"loss": 0.25})
        rec.pushed({"sync/bytes": 100.0})
        trainer.version = 3
        rec.end(rollouts)
        rec.log()
        rec.begin(1)
        rec.taken(rollouts.next_batch(1))
        rec.end(rollouts)
        rec.log()
    summary = rec.finish(rollouts, "sync")

    (phase, m, step), (_, skipped, step2), (last, row, _) = rows
    assert (phase, step, step2, last) == ("rl", 1, 2, "rl_summary")
    # the ended episodes: 5, two of them successes; 4 + 6 + 2 + 4 + 8 tokens generated
    assert m["reward_mean"] == 0.4 and m["success_rate"] == 0.4 and m["check/correct"] == 0.4
    assert m["rollout_tokens"] == 24.0 and m["zero_variance_group_frac"] == 1 / 3
    # staleness = version 2 - each kept episode's version: 1, 0, 2, 0
    assert (m["staleness_mean"], m["staleness_max"]) == (0.75, 2.0)
    assert (m["staleness/0"], m["staleness/1"], m["staleness/2"]) == (0.5, 0.25, 0.25)
    assert (m["loss"], m["sync/bytes"], m["version"], m["skipped"]) == (0.25, 100.0, 3, 0.0)
    assert (m["ledger/started"], m["ledger/trained"], m["ledger/filtered/zero_variance"]) == (
        5.0, 4.0, 1.0)
    assert (m["tool_calls/calculate"], m["engine/requests"], m["curriculum/level"]) == (
        3.0, 5.0, 2.0)
    assert m["train_s"] >= 0 and m["sync_s"] >= 0 and m["step_s"] >= m["rollout_s"]
    # the skipped step: nothing trained, the counters as of it
    assert skipped["skipped"] == 1.0 and "loss" not in skipped and "staleness_mean" not in skipped
    assert skipped["tool_calls/calculate"] == 0.0 and skipped["ledger/trained"] == 4.0
    # the summary: 4 trained of 5 started, staleness over the one trained step
    assert summary["ledger"] == {"started": 5, "trained": 4, "filtered/zero_variance": 1}
    assert (summary["staleness_mean"], summary["staleness_max"]) == (0.75, 2)
    assert summary["samples_per_s"] == pytest.approx(4 / summary["wall_s"])
    assert summary["rollout_train_ratio"] == pytest.approx(2.0 / rec.trainer_s)
    assert "ledger_unaccounted" not in summary
    assert row["ledger/started"] == 5.0 and row["staleness_mean"] == 0.75


def test_an_error_in_the_steps_logs_the_ledger_then_goes_on(trainer, caplog):
    rows: list = []
    cancelled = Counter({"started": 8, "dropped/cancelled_at_end": 8})
    rollouts = ScriptedRollouts([], at_close=cancelled)
    with (pytest.raises(ValueError, match="in the step"),
          recorder(trainer, rows).running(rollouts, "RL", 2, show=False)):
        raise ValueError("in the step")
    assert rows == [("rl_summary", {"ledger/started": 8.0,
                                    "ledger/dropped/cancelled_at_end": 8.0}, None)]
    # a wind-down that fails too is logged; the step's error is the one raised
    failing = ScriptedRollouts([], close_error=OSError("stuck (injected)"))
    with (caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="in the step"),
          recorder(trainer, []).running(failing, "RL", 2, show=False)):
        raise ValueError("in the step")
    assert "winding down the rollouts after the error below failed too: OSError: stuck " \
           "(injected)" in caplog.text


def test_idle_steps_skip_flat_steps_up_to_the_limit_and_fail_on_an_empty_one(caplog):
    rollouts = ScriptedRollouts([])
    rollouts.ledger.update({"started": 16, "filtered/zero_variance": 16})
    idle = IdleSteps(2, rollouts)
    flat = Taken([], [], [], {"groups_dropped": 4.0})
    with caplog.at_level(logging.WARNING):
        assert [idle.trainable(s, flat) for s in range(2)] == [False, False]
    assert idle.count == 2 and "rl step 2: every group had equal rewards" in caplog.text
    assert idle.trainable(2, Taken([episode("a", 0, 2, 1.0)], [0], [], {})) is True
    assert idle.count == 0  # a trained step ends the run of idle ones
    assert [idle.trainable(s, flat) for s in (3, 4)] == [False, False]
    with pytest.raises(RunError, match=r"^rl step 6: nothing to train \(3 step\(s\) in a row\)"
                                       r".*'started': 16.*rl.max_idle_steps=2\)$"):
        idle.trainable(5, flat)
    # a step left with nothing that no flat group explains (every episode dropped) fails at once
    with pytest.raises(RunError, match=r"^rl step 1: nothing to train \(1 step\(s\) in a row\)"):
        IdleSteps(5, rollouts).trainable(0, Taken([], [], [], {"groups_dropped": 0.0}))


def test_an_error_mid_rl_still_logs_the_ledger(calc_sft_dir, tmp_path):
    """A real tiny run whose `after_step` raises once step 1's weights are pushed: the error
    goes on, and metrics.jsonl holds the rl_summary row with the final ledger (sync: step 1's
    2 tasks x 4 samples started, each trained or filtered, no second step started)."""
    run = Run(load_config("configs/calculator.yaml", tiny_rl(calc_sft_dir, "rl.steps=3")),
              tmp_path)

    def after_step(step: int) -> None:
        raise RuntimeError(f"after step {step} (injected)")

    try:
        with pytest.raises(RuntimeError, match=r"after step 1 \(injected\)"):
            rl(run, after_step)
    finally:
        run.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["phase"] == "rl"]  # step 1 raised before its row
    [summary] = [r for r in rows if r["phase"] == "rl_summary"]
    ledger = {k.removeprefix("ledger/"): v for k, v in summary.items()
              if k.startswith("ledger/")}
    assert ledger["started"] == 8.0
    assert ledger["started"] == ledger.get("trained", 0.0) + sum(
        v for k, v in ledger.items() if k.startswith(("filtered/", "dropped/")))
