"""The algorithm library wired into training: advantages as the trainer assembles them, the
critic, dynamic sampling, overlong handling, key steps and pass@k, with hand-computed
numbers where the wiring adds math."""

import json
import math

import pytest
import torch
from helpers import cli, tiny_rl

from tiller.config import AlgorithmConfig, ConfigError, RLConfig, load_config
from tiller.controller import rl
from tiller.envs.verifiers import Reward
from tiller.models import resolve_device
from tiller.observe.evaluation import success_summary
from tiller.rollout.buffer import DataBuffer, Group
from tiller.rollout.trajectory import Status, Trajectory
from tiller.run import Run
from tiller.train.batch import Batch
from tiller.train.critic import Critic, explained_variance
from tiller.train.shaping import load_key_steps, rl_batch, train_reward
from tiller.train.trainer import PolicyTrainer, compute_advantages

CONFIG = "configs/calculator.yaml"


def traj(ids, mask, spans, reward=0.0, task="t", k=0, turn_rewards=None, status=Status.COMPLETED,
         logprobs=None):
    return Trajectory(task, k, tuple(ids), tuple(mask), tuple(logprobs or [0.0] * len(ids)), 1,
                      tuple(spans), (0,) * len(spans), (), Reward(reward, {}, turn_rewards),
                      status)


def close(x, expected, atol=1e-5):
    assert torch.allclose(x, torch.tensor(expected, dtype=x.dtype), atol=atol), x


# ---------------------------------------------------------------- advantages, assembled
def test_outcome_advantage_with_kl_in_reward():
    # rewards [1, 0], one group; the KL reward term sums per row: -0.2 and -0.2 -> r' = [0.8, -0.2]
    # dr_grpo: mean 0.3 -> A = [0.5, -0.5], on the masked tokens only
    batch = Batch.collate([traj([1, 2, 3], [0, 1, 1], [(1, 3)], 1.0),
                           traj([1, 2, 3], [0, 1, 0], [(1, 2)], 0.0)], 0)
    kl_reward = torch.tensor([[0.0, -0.1, -0.1], [0.0, -0.2, 0.0]])
    adv, returns = compute_advantages(batch, AlgorithmConfig(advantage="dr_grpo"), None, kl_reward)
    close(adv, [[0.0, 0.5, 0.5], [0.0, -0.5, 0.0]])
    assert returns is None


def test_turn_level_credit():
    # row 0: turns [1, 3) and [4, 5), per-turn rewards [0.5, 0], outcome 1 (added to the last
    # turn) and a KL reward of -0.2 on token 4 -> turn rewards [0.5, 0.8]; gamma_turn 0.5:
    # R = [0.5 + 0.5 * 0.8, 0.8] = [0.9, 0.8]. Row 1: one turn [1, 2), reward 0.2, outcome 0 ->
    # R = [0.2]. Per-turn dr_grpo baseline: turn 0 {0.9, 0.2}, mean 0.55 -> +-0.35; turn 1 has
    # row 0 only -> 0. Every token of a turn gets its turn's advantage; tool output (3) gets 0.
    batch = Batch.collate([
        traj([1, 2, 3, 9, 4, 0], [0, 1, 1, 0, 1, 0], [(1, 3), (4, 5)], 1.0,
             turn_rewards=(0.5, 0.0)),
        traj([1, 2], [0, 1], [(1, 2)], 0.0, turn_rewards=(0.2,)),
    ], 0)
    kl_reward = torch.zeros(2, 6)
    kl_reward[0, 4] = -0.2
    alg = AlgorithmConfig(advantage="dr_grpo", credit={"gamma_turn": 0.5})
    adv, _ = compute_advantages(batch, alg, None, kl_reward)
    close(adv, [[0.0, 0.35, 0.35, 0.0, 0.0, 0.0], [0.0, -0.35, 0.0, 0.0, 0.0, 0.0]])
    # a verifier that gives no turn rewards leaves the batch on the outcome estimator
    assert Batch.collate([traj([1, 2], [0, 1], [(1, 2)], 1.0)], 0).turn_rewards is None


def test_gae_takes_turn_rewards_and_skips_tool_spans():
    # tokens 1, 2 (turn 0), 3 (tool output, skipped), 4 (turn 1); per-token rewards: 0.5 on
    # token 2 (turn 0's end), outcome 1 on token 4. V = 0, gamma = lam = 1, no whitening:
    # A_4 = 1, A_2 = 0.5 + A_4 = 1.5, A_1 = 0 + A_2 = 1.5; returns = A + V.
    batch = Batch.collate([traj([1, 2, 3, 9, 4], [0, 1, 1, 0, 1], [(1, 3), (4, 5)], 1.0,
                                turn_rewards=(0.5, 0.0))], 0)
    alg = AlgorithmConfig(advantage="gae", critic={"gamma": 1.0, "lam": 1.0, "whiten": False})
    adv, returns = compute_advantages(batch, alg, torch.zeros(1, 5))
    close(adv, [[0.0, 1.5, 1.5, 0.0, 1.0]])
    close(returns, [[0.0, 1.5, 1.5, 0.0, 1.0]])


def test_explained_variance_hand_computed():
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    returns = torch.tensor([1.0, 0.0, 1.0, 0.0, 50.0])  # the off-mask entry never counts
    # V = 0.5 everywhere: R - V = +-0.5, Var 0.25 = Var R -> 0 (no better than the mean)
    assert explained_variance(torch.full((5,), 0.5), returns, mask) == pytest.approx(0.0)
    # V = [1, 0, 1, 0.5]: R - V = [0, 0, 0, -0.5], mean -0.125,
    # Var = (3 * 0.125^2 + 0.375^2) / 4 = 0.046875 -> 1 - 0.046875 / 0.25 = 0.8125
    values = torch.tensor([1.0, 0.0, 1.0, 0.5, -7.0])
    assert explained_variance(values, returns, mask) == pytest.approx(0.8125)
    assert math.isnan(explained_variance(values, torch.ones(5), mask))  # Var R = 0


# ---------------------------------------------------------------- trainer
def update_of(model_dir, batch, cfg, ref_model=None):
    from tiller.models import load_model

    model = load_model(model_dir)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    trainer = PolicyTrainer(model)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # delta = -gradient
    metrics = trainer.rl_step(batch, cfg, l_max=8, ref_model=ref_model)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before, metrics


def test_ppo_explained_variance_rises_on_a_fixed_batch(model):
    # One group whose reward depends on the completion. With gamma = lam = 1 the returns are the
    # reward on every token whatever V is, so the critic chases fixed targets. It can reach
    # EV = 2/3: the value before the first completion token cannot know the completion.
    trajs = [traj([5, 6, 7, 20 + i % 2, 30, 31], [0, 0, 0, 1, 1, 1], [(3, 6)], float(i % 2),
                  k=i) for i in range(4)]
    batch = Batch.collate(trajs, 0)
    cfg = RLConfig(micro_batch_size=4, algorithm={
        "preset": "ppo", "kl": {"beta": 0}, "critic": {"lam": 1.0, "value_lr": 3e-3}})
    trainer = PolicyTrainer(model)
    trainer.set_optimizer(lr=1e-6)  # the policy barely moves
    critic = Critic(model, cfg.algorithm.critic)
    assert not set(map(id, critic.model.parameters())) & set(map(id, model.parameters()))
    steps = [trainer.rl_step(batch, cfg, l_max=8, critic=critic) for _ in range(10)]
    curve = [m["explained_variance"] for m in steps]
    assert curve[0] == pytest.approx(0.0, abs=1e-6)  # the zero head predicts 0 everywhere
    assert sum(curve[-3:]) / 3 > 0.4 > sum(curve[:3]) / 3
    assert steps[-1]["value_loss"] < 0.5 * steps[0]["value_loss"]


# ---------------------------------------------------------------- controller
def tiny(sft_dir, *more):
    return load_config(CONFIG, tiny_rl(sft_dir, *more))


def last_rl_row(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl"][-1]


def test_buffer_admits_filters_and_takes_groups_in_launch_order():
    buffer = DataBuffer()
    members = buffer.admit([traj([1, 2], [0, 1], [(1, 2)], 1.0, task="a"),
                            traj([1, 2], [0, 1], [(1, 2)], 0.0, task="a", status=Status.ABORTED),
                            traj([1], [0], [], 0.0, task="a")])
    assert len(members) == 1  # aborted and empty ones are dropped, with their reason
    late, early, flat = (Group((0, 1, 0), "a", members), Group((0, 0, 1), "b", members * 2),
                         Group((0, 0, 0), "c", members))
    for g in (late, early, flat):
        buffer.add(g)
    buffer.filter(flat, "zero_variance")
    kept, groups = buffer.take([late, early])  # finished late-first, batched in launch order
    assert [t.task_id for t in kept] == ["a"] * 3 and groups.tolist() == [0, 0, 1]
    assert buffer.ready == []
    assert buffer.ledger == {"dropped/aborted": 1, "dropped/empty": 1,
                             "filtered/zero_variance": 1, "trained": 3}


@pytest.mark.parametrize("max_rounds, rounds, kept, dropped", [(3, 3, 2, 3), (2, 2, 1, 3)])
def test_dynamic_sampling_refills_and_logs(calc_sft_dir, tmp_path, monkeypatch, max_rounds,
                                           rounds, kept, dropped):
    seen: list[str] = []

    def reward(t, *_):  # the first three tasks drawn are flat, later ones split 1/0
        if t.task_id not in seen:
            seen.append(t.task_id)
        return 0.0 if seen.index(t.task_id) < 3 else float(t.sample_index == 0)

    monkeypatch.setattr("tiller.controller.train_reward", reward)
    cfg = tiny(calc_sft_dir, "rl.algorithm={preset: dapo, dynamic_sampling: "
               f"{{enabled: true, max_rounds: {max_rounds}}}}}")
    rl(Run(cfg, tmp_path))
    row = last_rl_row(tmp_path)
    # round 1 draws tasks 1-2 (both flat), round 2 draws 2 more (task 3 flat, task 4 kept),
    # round 3 draws the 1 missing group (task 5, kept); with 2 rounds the step trains on 1 group
    assert (row["sampling_rounds"], row["groups_kept"], row["groups_dropped"]) == (
        rounds, kept, dropped)
    assert row["zero_variance_group_frac"] == pytest.approx(dropped / (dropped + kept))
    assert row["ledger/filtered/zero_variance"] == 4 * dropped
    assert row["ledger/trained"] == 4 * kept


def test_overlong_soft_penalty_and_mask(calc_sft_dir, tmp_path):
    long = traj([1] + [2] * 90, [0] + [1] * 90, [(1, 91)], 1.0, status=Status.TRUNCATED)
    short = traj([1, 2], [0, 1], [(1, 2)], 1.0)
    # l_max 100, l_cache 20: 90 tokens -> (100 - 20 - 90) / 20 = -0.5; 1 token -> 0
    cfg = tiny(calc_sft_dir, "rl.algorithm={preset: dapo, l_max: 100, "
               "overlong: {mode: soft, l_cache: 20}}")
    alg = cfg.rl.algorithm
    assert [train_reward(t, alg, cfg.l_max, cfg.l_cache) for t in (long, short)] == [0.5, 1.0]
    # mask: the truncated episode leaves the loss, keeps its reward for the group statistics
    alg = tiny(calc_sft_dir, "rl.algorithm.overlong.mode=mask").rl.algorithm
    batch, stats = rl_batch([long, short], torch.tensor([0, 0]), [1.0, 1.0], 0, alg, 0.0)
    assert batch.loss_mask[0].sum() == 0 and batch.loss_mask[1].sum() == 1
    assert batch.rewards.tolist() == [1.0, 1.0] and stats == {"overlong_masked": 1.0}


def test_env_error_weight_scales_the_row_loss_exactly_once(calc_sft_dir, tmp_path):
    # one group of four, row 1 an env_error episode kept with weight w
    trajs = [traj([3, 4, 5 + i, 6 + 2 * i], [0, 1, 1, 1], [(1, 4)], float(i % 2), k=i,
                  status=Status.ENV_ERROR if i == 1 else Status.COMPLETED) for i in range(4)]
    alg = tiny(calc_sft_dir, "rl.env_error_weight=0.5").rl.algorithm
    cfg = RLConfig(micro_batch_size=4, max_grad_norm=1e9)  # token-mean
    delta = {}
    for w in (0.0, 0.5, 1.0):
        batch, stats = rl_batch(trajs, torch.tensor([0, 0, 0, 0]),
                                [t.reward.value for t in trajs], 0, alg, w)
        assert stats == {"env_error_trained": 1.0}
        assert batch.loss_mask.tolist() == [[0.0, 1.0, 1.0, 1.0]] * 4  # masks untouched
        assert batch.loss_weight.tolist() == [1.0, w, 1.0, 1.0]
        delta[w], _ = update_of(calc_sft_dir, batch, cfg)
    # SGD delta = -gradient = clean rows' part + w * the row's part: the weighted row's gradient
    # at w is w times its gradient at 1, and the clean rows' part is the same at every w
    # (their normalizer does not move)
    row = delta[1.0] - delta[0.0]
    assert row.abs().max() > 1e-4
    assert torch.allclose(delta[0.5], delta[0.0] + 0.5 * row, atol=1e-6)


def test_bf16_run_keeps_fp32_master_weights(calc_model_dir, tmp_path):
    run = Run(tiny(calc_model_dir, "model.dtype=bfloat16"), tmp_path)
    assert next(run.model.parameters()).dtype == torch.float32
    assert next(run.engine.model.parameters()).dtype == torch.bfloat16
    before = torch.cat([p.detach().flatten() for p in run.model.parameters()])
    batch = Batch.collate([traj([3, 4, 5 + i, 6 + 2 * i], [0, 1, 1, 1], [(1, 4)], float(i % 2),
                                k=i) for i in range(4)], 0)
    run.trainer.set_optimizer(lr=1e-6)
    run.trainer.rl_step(batch, RLConfig(micro_batch_size=4), l_max=8)
    after = torch.cat([p.detach().flatten() for p in run.model.parameters()])
    # AdamW's first step moves every weight with a gradient by ~lr; on bf16 weights (~0.02,
    # resolution ~1e-4) almost all of those updates would round away
    assert float((after != before).float().mean()) > 0.5
    run.push_weights()  # the engine's copy takes the update in its own dtype
    assert next(run.engine.model.parameters()).dtype == torch.bfloat16 and run.engine.version == 1


def test_cuda_without_cuda_is_one_config_error_line(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    code, out = cli("train", CONFIG, "model.device=cuda", "--output-dir", tmp_path / "run")
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and lines == [
        "error: config field model.device: got 'cuda'; CUDA is not available on this machine "
        "(use model.device=cpu or auto)"]


def first_generated_token_only(t: Trajectory, tokenizer) -> list[int]:
    """A key-step hook for the test: keep only each episode's first generated token."""
    first = t.loss_mask.index(1)
    return [int(i == first) for i in range(len(t.token_ids))]


def test_key_step_hook_narrows_the_loss_mask(calc_sft_dir, tmp_path):
    cfg = tiny(calc_sft_dir, "rl.algorithm.credit.key_steps=test_rl_wiring:"
               "first_generated_token_only")
    hook = load_key_steps(cfg.rl.algorithm.credit.key_steps)
    batch, _ = rl_batch([traj([1, 2, 3, 4], [0, 1, 1, 1], [(1, 4)], 1.0)], torch.tensor([0]),
                        [1.0], 0, cfg.rl.algorithm, 0.0, hook)
    assert batch.loss_mask.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    with pytest.raises(ConfigError, match="rl.algorithm.credit.key_steps: got 'no.such:hook'"):
        Run(tiny(calc_sft_dir, "rl.algorithm.credit.key_steps=no.such:hook"), tmp_path / "x")


# ---------------------------------------------------------------- evaluation
def test_pass_at_k_summary_with_intervals():
    # task a: 4 samples, 2 correct -> pass@1 0.5, pass@2 = 1 - C(2,2)/C(4,2) = 5/6;
    # task b: 4 samples, none correct -> 0 and 0
    trajs = [traj([1], [0], [], float(i < 2), task="a", k=i) for i in range(4)]
    trajs += [traj([1], [0], [], 0.0, task="b", k=i) for i in range(4)]
    s = success_summary(trajs, k=2)
    assert s["success"] == pytest.approx(0.25) and s["pass@2"] == pytest.approx(5 / 12)
    assert (s["tasks"], s["samples"]) == (2, 8)
    assert s["ci_low"] <= s["success"] <= s["ci_high"]
    assert s["pass@2_ci_low"] <= s["pass@2"] <= s["pass@2_ci_high"]
    assert "pass@1" not in success_summary(trajs)  # k = 1: success is pass@1
