"""Presets: each resolves to its paper's combination, reloads to itself and trains the tiny
pipeline; a knob the chosen algorithm ignores is an error naming it."""

import copy
import json

import pytest
import torch
import yaml
from helpers import cli, rl_rows, tiny_rl

from tiller.algorithms.presets import PRESETS
from tiller.config import Config, ConfigError, RLConfig, load_config
from tiller.controller import rl, train
from tiller.envs.verifiers import Reward
from tiller.rollout.trajectory import Status, Trajectory
from tiller.run import Run
from tiller.train.batch import Batch
from tiller.train.critic import Critic
from tiller.train.logprobs import token_logprobs
from tiller.train.shaping import train_reward
from tiller.train.trainer import PolicyTrainer

CONFIG = "configs/calculator.yaml"

# (advantage, loss, eps_low, eps_high, aggregation, kl beta, placement, estimator,
#  dynamic sampling, overlong, critic)
EXPECTED = {
    "grpo": ("grpo", "ppo_clip", 0.2, 0.2, "seq-mean-token-mean", 0.04, "loss", "k3",
             False, "none", False),
    "dapo": ("grpo", "ppo_clip", 0.2, 0.28, "token-mean", 0.0, None, None, True, "soft", False),
    "dr_grpo": ("dr_grpo", "ppo_clip", 0.2, 0.2, "seq-mean-token-sum-norm", 0.0, None, None,
                False, "none", False),
    "gspo": ("grpo", "gspo", 3e-4, 4e-4, "seq-mean-token-mean", 0.0, None, None, False, "none",
             False),
    "ppo": ("gae", "ppo_clip", 0.2, 0.2, "token-mean", 0.01, "reward", None, False, "none", True),
    "rloo": ("rloo", "ppo_clip", 0.2, 0.2, "seq-mean-token-sum", 0.05, "reward", None, False,
             "none", False),
    "reinforce_pp": ("reinforce_pp", "ppo_clip", 0.2, 0.2, "token-mean", 0.01, "reward", None,
                     False, "none", False),
}


def preset(name, **over):
    """The override that replaces the demo config's algorithm section with a preset."""
    return f"rl.algorithm={json.dumps({'preset': name, **over})}"


def test_every_preset_is_covered():
    assert set(EXPECTED) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_resolves_to_its_combination_and_reloads(name):
    cfg = load_config(CONFIG, [preset(name)])
    a = cfg.rl.algorithm
    got = (a.advantage, a.policy_loss, a.eps_low, a.eps_high, a.aggregation, a.kl.beta,
           a.kl.placement, a.kl.estimator, a.dynamic_sampling.enabled, a.overlong.mode,
           a.critic is not None)
    assert got == EXPECTED[name]
    # the run folder's resolved config.yaml loads back to the same config
    assert Config.model_validate(yaml.safe_load(yaml.safe_dump(cfg.model_dump()))) == cfg


def test_overrides_win_and_defaults_follow_the_chosen_loss():
    alg = load_config(CONFIG, [preset("dapo", eps_high=0.3)]).rl.algorithm
    assert (alg.eps_low, alg.eps_high) == (0.2, 0.3)
    # the preset's clip range belongs to its loss: switching the loss takes that loss's own
    alg = load_config(CONFIG, [preset("dapo", policy_loss="gspo")]).rl.algorithm
    assert (alg.eps_low, alg.eps_high) == (3e-4, 4e-4)
    alg = load_config(CONFIG, ["rl.algorithm.policy_loss=gspo"]).rl.algorithm
    assert (alg.eps_low, alg.eps_high) == (3e-4, 4e-4)  # never PPO's 0.2 by accident
    # switching off a part drops the preset's settings for it, silently (they were defaults)
    alg = load_config(CONFIG, [preset("ppo", advantage="grpo")]).rl.algorithm
    assert alg.critic is None and alg.credit.gamma_turn == 1.0
    alg = load_config(CONFIG, [preset("grpo", kl={"beta": 0})]).rl.algorithm
    assert alg.kl.estimator is None and alg.kl.placement is None
    cfg = load_config(CONFIG, [preset("dapo")])
    assert (cfg.l_max, cfg.l_cache) == (6 * 48, 58)  # the episode's budget and 20% of it


@pytest.mark.parametrize(
    "override, knob",
    [
        ("rl.algorithm.critic.gamma=0.9", "rl.algorithm.critic.gamma"),
        (preset("gspo", clip_ratio_c=3), "rl.algorithm.clip_ratio_c"),
        ("rl.algorithm.overlong.l_cache=16", "rl.algorithm.overlong.l_cache"),
        ("rl.algorithm.kl.estimator=k2", "rl.algorithm.kl.estimator"),
        ("rl.algorithm.kl.off_after=5", "rl.algorithm.kl.off_after"),
        (preset("ppo", kl={"estimator": "k2"}), "rl.algorithm.kl.estimator"),
        ("rl.algorithm.l_max=100", "rl.algorithm.l_max"),
        ("rl.algorithm.dynamic_sampling.max_rounds=5", "rl.algorithm.dynamic_sampling.max_rounds"),
        (preset("ppo", credit={"turn_baseline": "pooled"}), "rl.algorithm.credit.turn_baseline"),
    ],
)
def test_ignored_knob_is_an_error_naming_it(override, knob):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [override])
    assert str(e.value).startswith(f"config field {knob}: got ")
    assert "the algorithm ignores it" in str(e.value)


@pytest.mark.parametrize(
    "override, words",
    [
        ("rl.algorithm.preset=ppo2", ["rl.algorithm.preset", "'ppo2'", "dapo"]),
        ("rl.algorithm.kl.estimator=k9", ["rl.algorithm.kl.estimator", "k3"]),
        ("rl.algorithm.aggregation=mean", ["rl.algorithm.aggregation", "token-mean"]),
        (preset("dapo", overlong={"mode": "soft", "l_cache": 400}),
         ["rl.algorithm.overlong.l_cache", "400", "l_max = 288"]),
        ("eval.pass_k=4", ["eval.pass_k", "samples_per_task >= k"]),
    ],
)
def test_bad_algorithm_fields_name_the_field(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [override])
    assert all(w in str(e.value) for w in words), str(e.value)


def test_ignored_knob_is_one_line_on_the_cli(tmp_path):
    code, out = cli("train", CONFIG, preset("gspo", clip_ratio_c=3), "--output-dir",
                    tmp_path / "run")
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("error: config field rl.algorithm.clip_ratio_c")


def fixed_batch():
    """Two groups of three, completions of 2-4 tokens; group a rewards [1, 0, 0], group b
    [1, 1, 0], so the estimators and aggregations do not all coincide on it."""
    rows = [("a", 1.0, [10, 11]), ("a", 0.0, [12, 13, 14]), ("a", 0.0, [15, 16, 17, 18]),
            ("b", 1.0, [20, 21, 22, 23]), ("b", 1.0, [24, 25]), ("b", 0.0, [26, 27, 28])]
    trajs = []
    for k, (task, reward, completion) in enumerate(rows):
        ids = [3, 4, 5, 6, *completion]
        trajs.append(Trajectory(task, k, tuple(ids), (0,) * 4 + (1,) * len(completion),
                                (0.0,) * len(ids), 4, ((4, len(ids)),), (0,), (), Reward(reward),
                                Status.COMPLETED))
    return Batch.collate(trajs, 0)


def sequence_logprobs(model, batch):
    with torch.no_grad():
        return (token_logprobs(model, batch)[0] * batch.loss_mask).sum(-1)


@pytest.mark.parametrize("ppo_epochs", [1, 2])
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_update_moves_rewarded_up_and_unrewarded_down(name, ppo_epochs, model):
    batch = fixed_batch()
    batch.rollout_logprobs = token_logprobs(model, batch)[0].detach() * batch.loss_mask
    cfg = RLConfig(micro_batch_size=4, ppo_epochs=ppo_epochs, algorithm={"preset": name})
    alg = cfg.algorithm
    ref = copy.deepcopy(model) if alg.kl.beta > 0 else None
    critic = Critic(model, alg.critic) if alg.critic is not None else None
    trainer = PolicyTrainer(model)
    trainer.set_optimizer(lr=1e-3)
    before = sequence_logprobs(model, batch)
    trainer.rl_step(batch, cfg, l_max=8, ref_model=ref, critic=critic)
    moved = sequence_logprobs(model, batch) - before
    rewarded = batch.rewards > 0
    assert (moved[rewarded] > 0).all() and (moved[~rewarded] < 0).all(), moved


def tiny(sft_dir):
    return tiny_rl(sft_dir, "rl.steps=2")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_trains_the_tiny_pipeline(name, calc_sft_dir, tmp_path, monkeypatch):
    # The one-step-SFT model never succeeds, so every group would be flat. A synthetic reward
    # (odd samples +1, on top of the real one and its shaping) gives every group signal.
    monkeypatch.setattr("tiller.controller.train_reward",
                        lambda t, *a: train_reward(t, *a) + t.sample_index % 2)
    extra = ["eval.samples_per_task=2", "eval.pass_k=2"] if name == "grpo" else []
    summary = train(load_config(CONFIG, [*tiny(calc_sft_dir), preset(name), *extra]), tmp_path)
    rows = rl_rows(tmp_path)
    assert len(rows) == 2  # a step with nothing to train stops the run (RunError)
    assert summary["heldout_after_rl"]["tasks"] == 8
    keys = set(rows[-1])
    assert {"entropy", "clip_frac_low", "clip_frac_high", "zero_variance_group_frac",
            "importance_weight_mean", "importance_weight_max", "logp_mismatch_max"} <= keys
    assert ("kl" in keys) == (EXPECTED[name][5] > 0)
    assert ("explained_variance" in keys and "value_loss" in keys) == (name == "ppo")
    assert ("sampling_rounds" in keys) == (name == "dapo")
    if name == "grpo":
        held = summary["heldout_after_rl"]
        assert held["samples"] == 16 and held["pass@2_ci_low"] <= held["pass@2"] <= 1.0


def test_beta_zero_builds_and_runs_no_reference(calc_sft_dir, tmp_path, monkeypatch):
    passes = []  # True: a no-grad pass of the policy, False: of the reference
    real = PolicyTrainer._logprobs

    def spy(self, model, batch, micro_batch_size):
        passes.append(model is self.model)
        return real(self, model, batch, micro_batch_size)

    monkeypatch.setattr(PolicyTrainer, "_logprobs", spy)
    rl(Run(load_config(CONFIG, [*tiny(calc_sft_dir), preset("dr_grpo")]), tmp_path / "a"))
    assert passes == []  # beta = 0: no reference, no extra pass
    # beta > 0 switched off after one step: one reference pass, then none
    rl(Run(load_config(CONFIG, [*tiny(calc_sft_dir), preset("grpo", kl={"off_after": 1})]),
           tmp_path / "b"))
    assert passes == [False]
    assert [r.get("kl_beta", 0.0) for r in rl_rows(tmp_path / "b")] == [0.04, 0.0]
