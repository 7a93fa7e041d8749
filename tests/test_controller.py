"""The schedule's failure rules: a run that cannot learn stops with one line naming why, and
the metrics' global step never goes backwards."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import TINY_RUN, cli, saved_model, tiny_rl
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tiller.config import load_config
from tiller.controller import rl, train
from tiller.envs.verifiers import Reward
from tiller.errors import RunError
from tiller.observe.health import EnvErrorTrend
from tiller.rollout.collect import check_aborted, rollout_metrics
from tiller.rollout.trajectory import Status, Trajectory
from tiller.run import Run

CONFIG = "configs/calculator.yaml"


def from_sft(sft_dir, *more):
    return load_config(CONFIG, tiny_rl(sft_dir, *more))


def break_engine(run: Run) -> None:
    """A real engine failure: NaN weights make sampling raise inside the engine."""
    with torch.no_grad():
        for p in run.engine.model.parameters():
            p.fill_(float("nan"))


def test_a_broken_engine_fails_the_run_naming_the_first_error(calc_sft_dir, tmp_path):
    run = Run(from_sft(calc_sft_dir), tmp_path)
    break_engine(run)
    with pytest.raises(RunError) as e:
        rl(run)
    msg = str(e.value)
    assert "rl/0: 8 of 8 episodes aborted (rl.max_aborted_frac=0.1)" in msg
    assert "first error: engine: RuntimeError: the model's logits are not finite" in msg
    assert "\n" not in msg


def test_all_aborted_under_a_permissive_threshold_is_nothing_to_train(calc_sft_dir, tmp_path):
    run = Run(from_sft(calc_sft_dir, "rl.max_aborted_frac=1.0"), tmp_path)
    break_engine(run)
    with pytest.raises(RunError, match=r"rl step 1: nothing to train.*'dropped/aborted': 8"):
        rl(run)


def test_flat_steps_are_skipped_until_max_idle_steps(calc_sft_dir, tmp_path):
    # the one-step-SFT model never succeeds: under dynamic sampling every group is flat
    cfg = from_sft(calc_sft_dir, "rl.steps=3", "rl.max_idle_steps=1",
                   "rl.algorithm={preset: dapo}")
    with pytest.raises(RunError, match=r"^rl step 2: nothing to train \(2 step\(s\) in a row\)"):
        rl(Run(cfg, tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (first,) = [r for r in rows if r["phase"] == "rl"]
    assert first["skipped"] == 1.0 and first["ledger/filtered/zero_variance"] == 24


def traj(status, error=""):
    return Trajectory("t", 0, (1, 2), (0, 1), (0.0, 0.0), 1, ((1, 2),), (0,), (),
                      Reward(0.0), status, info={"error": error} if error else {})


def test_aborted_episodes_are_counted_in_the_rollout_metrics():
    m = rollout_metrics([traj(Status.ABORTED), traj(Status.COMPLETED), traj(Status.ABORTED),
                         traj(Status.ENV_ERROR)])
    assert (m["aborted_rate"], m["env_error_rate"]) == (0.5, 0.25)


def test_the_aborted_threshold_is_a_strict_share_and_names_the_first_error():
    one = [traj(Status.ABORTED, "engine: boom")] + [traj(Status.COMPLETED)] * 7
    check_aborted(one, 0.125, "rl/3")  # 1 of 8 is not more than 0.125
    two = [traj(Status.COMPLETED), traj(Status.ABORTED, "engine: first"),
           traj(Status.ABORTED, "engine: second")] + [traj(Status.COMPLETED)] * 5
    with pytest.raises(RunError, match=r"^rl/3: 2 of 8 episodes aborted "
                       r"\(rl.max_aborted_frac=0.125\); first error: engine: first$"):
        check_aborted(two, 0.125, "rl/3")


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_sft_without_completed_demos_is_one_line(tmp_path, schedule):
    # every demo needs a tool call and an answer: with one turn none completes
    code, out = cli("train", CONFIG, *TINY_RUN, "env.max_turns=1", "sft.imperfect_fraction=0",
                    f"sft.lr_schedule={schedule}", "-o", tmp_path)
    assert code == 1, out
    line = out.strip()
    assert line.startswith("error: sft: no expert demonstration completed") and "\n" not in line


def test_unimportable_agent_loop_is_one_line(tmp_path):
    code, out = cli("train", CONFIG, *TINY_RUN, "agent.loop=no.such:loop", "-o", tmp_path)
    assert code == 2
    assert out.strip().startswith(
        "error: config field agent.loop: got 'no.such:loop'; cannot import it: "
        "ModuleNotFoundError")
    assert "\n" not in out.strip()


@pytest.mark.slow
def test_metrics_share_one_monotonic_global_step(tmp_path):
    summary = train(load_config(CONFIG, TINY_RUN), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps)
    # TensorBoard gets the same steps, with the phase in the scalar's name
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("rl/reward_mean")] == [
        r["step"] for r in rows if r["phase"] == "rl"]
    assert [e.step for e in events.Scalars("sft/sft_loss")] == [
        r["step"] for r in rows if r["phase"] == "sft"]
    # the env_error trend is in every RL row and, per weight version, in the summary
    assert all(r["env_error_rising"] == 0.0 for r in rows if r["phase"] == "rl")
    sampled_at = {r["step"] - 1 for r in rows if r["phase"] == "rl"}  # sampled, then trained
    assert set(summary["rl"]["env_error_rate_by_version"]) == sampled_at
    sft = [r for r in rows if r["phase"] == "sft"]
    rl_rows = [r for r in rows if r["phase"] == "rl"]
    # SFT: 64 demos at most / batch 32 -> 2 steps; RL: one optimizer step per RL step
    assert [r["phase_step"] for r in rl_rows] == [1, 2]
    assert rl_rows[0]["step"] == sft[-1]["step"] + 1 and rl_rows[1]["step"] == sft[-1]["step"] + 2
    evals = {r["phase"]: r["step"] for r in rows if r["phase"].startswith("eval")}
    assert evals == {"eval_sft": sft[-1]["step"], "eval_rl": rl_rows[-1]["step"]}


def test_env_error_rate_per_version_warns_when_it_rises(caplog):
    def batch(version, errors, n=10):
        return [Trajectory("t", i, (1,), (0,), (0.0,), 1, (), (version,), (), Reward(0.0),
                           Status.ENV_ERROR if i < errors else Status.COMPLETED)
                for i in range(n)]

    trend = EnvErrorTrend(window=2, margin=0.05)
    with caplog.at_level(logging.WARNING, logger="tiller.observe.health"):
        for v, errors in enumerate([1, 1, 1, 1]):
            assert trend.update(batch(v, errors), v)["env_error_rising"] == 0.0
        m = trend.update(batch(4, 3), 4)  # last two versions: 4/20 against 2/20 at the start
    assert m == {"env_error_rising": 1.0, "env_error_rate_first": 0.1,
                 "env_error_rate_recent": 0.2}
    assert trend.by_version() == {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1, 4: 0.3}
    assert "env_error rate rose from 0.100" in caplog.text


@pytest.mark.parametrize("sft_difficulty, one_call_each", [(1, True), (None, False)])
def test_sft_difficulty_draws_the_demonstrations_at_that_difficulty(
        calc_model_dir, tmp_path, sft_difficulty, one_call_each):
    from tiller.controller import sft

    cfg = load_config(CONFIG, [
        *saved_model(calc_model_dir), "env.difficulty=3", "sft.tasks=48",
        "sft.imperfect_fraction=0", "sft.epochs=1",
        *([f"sft.difficulty={sft_difficulty}"] if sft_difficulty else [])])
    run = Run(cfg, tmp_path)
    try:
        out = sft(run)
    finally:
        run.close()
    demos = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["phase"] == "sft_demos"][0]
    # calculator: one operation per call, 1..difficulty operations per task
    assert out["demonstrations"] == 48 and out["expert_success"] == 1.0
    assert (demos["tool_calls/calculate"] == 48) is one_call_each, demos


def test_sft_tasks_beyond_the_sft_difficulty_task_space_name_sft_difficulty(tmp_path):
    code, out = cli("train", CONFIG, *TINY_RUN, "env.difficulty=3", "sft.difficulty=1",
                    "sft.tasks=100000", "-o", tmp_path)
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert "config field sft.tasks: got 100000" in out
    assert "at sft.difficulty=1" in out, out


@pytest.mark.slow
def test_a_failing_trace_close_fails_the_run_but_keeps_its_summary(tmp_path, monkeypatch):
    from tiller.observe.traces import TraceWriter

    def fail(self):
        raise RunError("traces: the writer did not finish (injected)")

    monkeypatch.setattr(TraceWriter, "close", fail)
    with pytest.raises(RunError, match="injected"):
        train(load_config(CONFIG, [*TINY_RUN, "logging.tensorboard=false"]), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["heldout_after_rl"]["tasks"] == 16 and summary["timings"]["total_s"] > 0
