"""rl.reward_control: random permutes a step's verifier values, constant replaces them, none
leaves them; a run under a control, on a policy the verifier pays half the time, trains on the
controlled value (the traced advantages) while its logged success stays the verifier's, and
constant under GRPO leaves the weights where they were."""

from __future__ import annotations

import pytest
import torch
from helpers import rl_rows, tiny_rl, trained_episodes
from safetensors.torch import load_file

from tiller.config import ConfigError, load_config
from tiller.controller import train
from tiller.envs.verifiers import Reward
from tiller.errors import RunError
from tiller.train.reward_control import RewardControl

CONFIG = "configs/calculator.yaml"
REWARDS = [Reward(v) for v in (1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.0)]


def test_random_is_a_seeded_permutation_of_the_steps_values():
    ctl = RewardControl("random", None, seed=3)
    real = [r.value for r in REWARDS]
    step0, step1 = ctl.apply(REWARDS, 0), ctl.apply(REWARDS, 1)
    assert sorted(step0) == sorted(real) and sorted(step1) == sorted(real)  # mean, distribution
    assert step0 == RewardControl("random", None, seed=3).apply(REWARDS, 0)  # reproducible
    assert step0 != step1 != real  # another draw each step, unlinked from the trajectory
    assert RewardControl("random", None, seed=4).apply(REWARDS, 0) != step0
    m = ctl.metrics(REWARDS, step0)
    assert m["reward_control/trained_mean"] == pytest.approx(sum(real) / len(real))
    same = sum(a == b for a, b in zip(step0, real, strict=True))
    assert m["reward_control/agree_frac"] == same / 12


def test_constant_and_none():
    assert RewardControl("constant", None, 0).apply(REWARDS, 5) == [0.0] * 12
    assert RewardControl("constant", 0.25, 0).apply(REWARDS, 5) == [0.25] * 12
    none = RewardControl("none", None, 0)
    assert none.apply(REWARDS, 0) == [r.value for r in REWARDS]
    assert none.metrics(REWARDS, [0.0] * 12) == {}


def test_turn_rewards_would_bypass_the_control_so_the_run_stops():
    with pytest.raises(RunError, match="turn rewards"):
        RewardControl("random", None, 0).apply([Reward(1.0, turn_rewards=(0.5,))], 2)


def test_config_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"rl.reward_control_value: got 1.0; it only applies "
                                          r"with rl.reward_control: constant"):
        load_config(CONFIG, ["rl.reward_control=random", "rl.reward_control_value=1.0"])
    with pytest.raises(ConfigError, match=r"rl.reward_control: got 'noise'"):
        load_config(CONFIG, ["rl.reward_control=noise"])


def half_expert(calc_sft_dir, *more):
    """A tiny run whose odd samples are the scripted expert's (tests/half_expert_loop.py): the
    verifier pays 1 on half of every group, so the real reward carries a signal to remove."""
    return load_config(CONFIG, tiny_rl(calc_sft_dir, "rl.steps=2",
                                       "agent.loop=half_expert_loop:run_episode", *more))


def trained(run_dir):
    """(verifier success, the advantage trained with) of every trained RL episode."""
    out = [(r["reward"] >= 1.0, r["advantage"])
           for r in trained_episodes(run_dir / "traces.sqlite")]
    assert len(out) == 16  # 2 steps x 2 groups x 4 samples
    return out


@pytest.mark.slow
def test_constant_under_grpo_trains_on_it_logs_the_real_reward_and_moves_nothing(
        calc_sft_dir, tmp_path):
    cfg = half_expert(calc_sft_dir, "rl.reward_control=constant",
                      "rl.reward_control_value=1.0")
    train(cfg, tmp_path)
    rows = rl_rows(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert r["reward_control/trained_mean"] == 1.0  # what RL trained on
        # the logged figures are the verifier's: half of every group succeeds
        assert r["reward_mean"] == 0.5 and r["success_rate"] == 0.5
        assert r["reward_control/agree_frac"] == 0.5  # the successes' value was 1.0 already
    # the real reward had a signal; the constant leaves none: every advantage is 0
    assert {s for s, _ in trained(tmp_path)} == {True, False}
    assert all(a == 0.0 for _, a in trained(tmp_path))
    # so no policy gradient at all (with overlong.mode none, as here: a soft overlong penalty
    # would still vary with length)
    before = load_file(calc_sft_dir / "model.safetensors")
    after = load_file(tmp_path / "checkpoints/final/model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_random_control_trains_on_rewards_unlinked_from_success(calc_sft_dir, tmp_path):
    train(half_expert(calc_sft_dir), tmp_path / "real")
    train(half_expert(calc_sft_dir, "rl.reward_control=random"), tmp_path / "rand")
    # with the real reward every success is above its group's mean, every failure below
    assert all((a > 0) == s for s, a in trained(tmp_path / "real"))
    # shuffled rewards: the same mean and logged success, but some failures were rewarded
    # (and successes not), so some advantages disagree with success
    rows = rl_rows(tmp_path / "rand")
    for r in rows:
        assert r["success_rate"] == 0.5 and r["reward_control/trained_mean"] == 0.5
        assert r["reward_control/agree_frac"] < 1.0
    assert sum((a > 0) != s for s, a in trained(tmp_path / "rand")) > 0
    a = load_file(tmp_path / "real/checkpoints/final/model.safetensors")
    b = load_file(tmp_path / "rand/checkpoints/final/model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_a_judge_with_a_reward_control_is_refused():
    from tiller.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rl.judge.fn: got 'tiller.train.judges:grounded_"
                                          "answer'; the judge term is paid on the verifier"):
        load_config(None, ["model.build={}", "rl.reward_control=random",
                           "rl.judge.fn=tiller.train.judges:grounded_answer"])
