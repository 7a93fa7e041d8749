import asyncio
import copy
import math
from types import SimpleNamespace

import pytest
import torch

from tiller.algorithms import ADVANTAGES, AGGREGATIONS
from tiller.config import ConfigError, RLConfig
from tiller.engine.api import SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.updates import WeightSyncError, WeightUpdate
from tiller.envs.verifiers import Reward
from tiller.models import load_model
from tiller.rollout.trajectory import Status, Trajectory
from tiller.train.batch import Batch
from tiller.train.critic import Critic
from tiller.train.logprobs import token_logprobs
from tiller.train.trainer import PolicyTrainer, compute_advantages


def make_traj(prompt, completion, reward, task="task"):
    ids = prompt + completion
    return Trajectory(task, 0, tuple(ids), (0,) * len(prompt) + (1,) * len(completion),
                      (0.0,) * len(ids), len(prompt), ((len(prompt), len(ids)),), (0,), (),
                      Reward(reward), Status.COMPLETED)


def seq_logprob(model, traj, pad):
    batch = Batch.collate([traj], pad)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    return float((logp * batch.loss_mask).sum())


def test_group_advantages_hand_computed():
    # group 0: r = [1, 0, 0, 1] -> mean 0.5, unbiased std sqrt(1/3) = 0.57735
    # A = +-0.5 / 0.57735 = +-0.866025; group 1 (all equal) -> 0; group 2 (size 1) -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.7])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = ADVANTAGES["grpo"](rewards, groups)
    expected = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0, 0.0])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_grpo_step_raises_probability_of_rewarded_sequence(model, tokenizer):
    pad = tokenizer.pad_token_id
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
    good = make_traj(prompt, tokenizer.encode("The answer is 42.", add_special_tokens=False), 1.0)
    bad = make_traj(prompt, tokenizer.encode("The answer is 41.", add_special_tokens=False), 0.0)
    # engine logprobs = the current policy's, as on-policy sampling would report them
    trajs = []
    for t in (good, bad):
        b = Batch.collate([t], pad)
        with torch.no_grad():
            lp, _ = token_logprobs(model, b)
        trajs.append(t.__class__(**{**t.__dict__, "logprobs": tuple(lp[0].tolist())}))
    before = [seq_logprob(model, t, pad) for t in trajs]
    trainer = PolicyTrainer(model)
    trainer.set_optimizer(lr=1e-3)
    # rewards 1 and 0 in one group (same task id): grpo advantages +-0.707
    metrics = trainer.rl_step(Batch.collate(trajs, pad), RLConfig(micro_batch_size=1), l_max=64)
    after = [seq_logprob(model, t, pad) for t in trajs]
    assert after[0] > before[0] and after[1] < before[1]
    assert trainer.version == 1
    assert metrics["logp_mismatch_max"] < 1e-4  # the supplied logprobs were the policy's own


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def clip_batch():
    """Two groups of two; completions differ per row so every token has its own gradient."""
    trajs = [make_traj([3, 4, 5, 6], [7 + i, 8 + 2 * i, 9 + i], float(i % 2), task=f"t{i // 2}")
             for i in range(4)]
    return Batch.collate(trajs, 0)


def sgd_step(model_dir, batch, cfg, lr=1.0):
    """One rl_step of plain SGD (delta = -lr * gradient) on a fresh copy of the model."""
    m = load_model(model_dir)
    trainer = PolicyTrainer(m)
    trainer.optimizer = torch.optim.SGD(m.parameters(), lr=lr)
    return m, trainer, trainer.rl_step(batch, cfg, l_max=8)


@pytest.mark.parametrize("mini_batches, ppo_epochs, loss", [
    (2, 1, "ppo_clip"), (1, 2, "ppo_clip"), (1, 2, "gspo")])
def test_clipping_acts_after_the_first_optimizer_step(calc_model_dir, mini_batches, ppo_epochs,
                                                      loss):
    # logp_old is fixed before the first update, so later steps see rho != 1 (lr 1 moves the
    # tiny model's log-probabilities by more than the 0.2 clip range)
    cfg = RLConfig(micro_batch_size=8, max_grad_norm=1e9, mini_batches=mini_batches,
                   ppo_epochs=ppo_epochs, algorithm={"policy_loss": loss,
                                                     "aggregation": "token-mean"})
    _, trainer, metrics = sgd_step(calc_model_dir, clip_batch(), cfg)
    assert metrics["clip_frac"] > 0
    assert metrics["clip_frac"] == pytest.approx(
        metrics["clip_frac_low"] + metrics["clip_frac_high"])
    assert trainer.version == mini_batches * ppo_epochs


def test_a_batch_smaller_than_mini_batches_takes_one_step_per_row(model):
    trainer = PolicyTrainer(model)
    trainer.set_optimizer(lr=1e-3)
    # a small batch at run time (dynamic sampling, dropped env errors): no empty optimizer step
    m = trainer.rl_step(clip_batch(), RLConfig(micro_batch_size=8, mini_batches=6), l_max=8)
    assert m["optimizer_steps"] == 4 and trainer.version == 4
    # the configured batch itself cannot have fewer rows than steps: an error at load
    with pytest.raises(ConfigError, match="expected at most rl.tasks_per_step \\* "
                       "rl.group_size = 8"):
        RLConfig(tasks_per_step=2, group_size=4, mini_batches=9)


def test_clipped_tokens_get_no_gradient(calc_model_dir):
    batch = clip_batch()
    alg = {"aggregation": "token-mean"}  # grpo advantages, ppo_clip 0.2 / 0.2
    cfg = RLConfig(micro_batch_size=8, max_grad_norm=1e9, ppo_epochs=2, algorithm=alg)
    two, _, metrics = sgd_step(calc_model_dir, batch, cfg)
    # epoch 1 alone is the plain policy gradient (rho = 1): replay it to get the weights that
    # epoch 2 starts from
    one, _, _ = sgd_step(calc_model_dir, batch, RLConfig(micro_batch_size=8, max_grad_norm=1e9,
                                                         algorithm=alg))
    with torch.no_grad():
        logp0, _ = token_logprobs(load_model(calc_model_dir), batch)
    # epoch 2 by hand: token-mean of -rho * A over the tokens that were NOT clipped only
    logp1, _ = token_logprobs(one, batch)
    mask = batch.loss_mask
    adv = compute_advantages(batch, cfg.algorithm)[0]
    ratio = torch.exp(logp1 - logp0)
    clipped = (((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))).float() * mask
    assert 0 < clipped.sum() < mask.sum()  # both kinds of token are in the batch
    (-(ratio * adv * mask * (1 - clipped)).sum() / mask.sum()).backward()
    expected = torch.cat([(p - p.grad).detach().flatten() for p in one.parameters()])
    assert torch.allclose(params(two), expected, atol=1e-5)
    # the clip fraction counts epoch 2's clipped tokens over both epochs' token visits
    assert metrics["clip_frac"] == pytest.approx(float(clipped.sum()) / (2 * float(mask.sum())))


def rollout_at(batch, logp, shift):
    """`batch` with the engine's logprobs set to `logp + shift` on generated tokens."""
    out = copy.copy(batch)
    out.rollout_logprobs = (logp + shift) * batch.loss_mask
    return out


# (settings, the uniform weight when the engine reported logprobs ln 2 below the trainer's,
# i.e. rho = exp(logp_old - logp_rollout) = 2 on every token, is_truncated_frac, is_masked_frac)
CORRECTIONS = [
    ({"off_policy": "tis", "is_cap": 5.0}, 2.0, 0.0, 0.0),
    ({"off_policy": "tis", "is_cap": 1.5}, 1.5, 1.0, 0.0),
    ({"off_policy": "decoupled", "is_cap": 5.0}, 2.0, 0.0, 0.0),
    ({"off_policy": "decoupled", "is_cap": 1.5}, 0.0, 0.0, 1.0),  # 2 > 1.5: filtered out
    ({"off_policy": "decoupled_tis", "is_cap": 1.5}, 1.5, 1.0, 0.0),  # 2 > 1.5: capped
    ({"off_policy": "seq_is", "is_cap": 5.0}, 5.0, 1.0, 0.0),  # 2^3 per 3-token row, capped
    ({"off_policy": "mis"}, 2.0, 0.0, 0.0),  # 2 is inside [0.5, 5]: kept with its ratio
    ({"off_policy": "mis", "mis_high": 1.5}, 0.0, 0.0, 1.0),  # 2 > 1.5: every token removed
    ({"off_policy": "mis_mask"}, 1.0, 0.0, 0.0),  # inside the band: kept, not reweighted
]


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo", "sapo"])
def test_off_policy_weight_multiplies_every_policy_loss(calc_model_dir, loss):
    batch = clip_batch()
    with torch.no_grad():
        logp_old, _ = token_logprobs(load_model(calc_model_dir), batch)
    cfg = {"micro_batch_size": 8, "max_grad_norm": 1e9}
    model, _, _ = sgd_step(calc_model_dir, rollout_at(batch, logp_old, 0.0),
                           RLConfig(**cfg, algorithm={"policy_loss": loss}))
    plain = params(model) - params(load_model(calc_model_dir))
    assert plain.abs().max() > 1e-4
    for settings, weight, truncated, masked in CORRECTIONS:
        alg = {"policy_loss": loss, **settings}
        model, _, m = sgd_step(calc_model_dir, rollout_at(batch, logp_old, -math.log(2.0)),
                               RLConfig(**cfg, algorithm=alg))
        delta = params(model) - params(load_model(calc_model_dir))
        assert torch.allclose(delta, weight * plain, atol=1e-6, rtol=1e-4), settings
        assert m["is_weight_mean"] == pytest.approx(weight, abs=1e-5), settings
        assert m["is_weight_max"] == pytest.approx(weight, abs=1e-5), settings
        assert (m["is_truncated_frac"], m["is_masked_frac"]) == (truncated, masked), settings
        assert m["importance_weight_mean"] == pytest.approx(2.0, abs=1e-5)  # before correcting


def test_decoupled_recomputes_the_proximal_policy_with_one_optimizer_step(calc_model_dir):
    # sampled by the initial weights (logp0); the trainer's weights have moved since, so the
    # behaviour weight min(exp(logp_prox - logp0), C) of decoupled_tis is not 1 on the first
    # (only) pass; decoupled would zero the capped tokens instead (its weight is hand-tested)
    batch = clip_batch()
    with torch.no_grad():
        logp0, _ = token_logprobs(load_model(calc_model_dir), batch)
    moved = load_model(calc_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = copy.deepcopy(moved.state_dict())
    alg = {"off_policy": "decoupled_tis", "is_cap": 1.2, "aggregation": "token-mean"}
    cfg = RLConfig(micro_batch_size=8, max_grad_norm=1e9, algorithm=alg)
    forwards = []
    trainer = PolicyTrainer(moved)  # (its start-up check of the output layer runs one forward)
    moved.model.register_forward_hook(lambda *_: forwards.append(1))  # the transformer
    trainer.optimizer = torch.optim.SGD(moved.parameters(), lr=1.0)
    m = trainer.rl_step(rollout_at(batch, logp0, 0.0), cfg, l_max=8)
    assert len(forwards) == 2 and trainer.version == 1  # the no-grad prepass, then the update
    # by hand: logp_prox with the moved weights, w = min(exp(logp_prox - logp0), 1.2), and the
    # token-mean of -rho * A * w with rho = exp(logp - logp_prox) (1 in value)
    hand = load_model(calc_model_dir)
    hand.load_state_dict(state)
    mask = batch.loss_mask
    logp, _ = token_logprobs(hand, batch)
    prox = logp.detach()
    w = torch.exp(prox - logp0).clamp(max=1.2)
    on = w[mask > 0]
    assert on.min() < 0.9 and (on == 1.2).any()  # rho != 1: some tokens down, some capped
    assert m["is_weight_mean"] == pytest.approx(float(on.mean()), abs=1e-5)
    assert m["is_weight_max"] == pytest.approx(1.2)
    assert m["is_truncated_frac"] == pytest.approx(float((torch.exp(prox - logp0)[mask > 0]
                                                          > 1.2).float().mean()))
    adv = compute_advantages(batch, cfg.algorithm)[0]
    (-(torch.exp(logp - prox) * adv * w * mask).sum() / mask.sum()).backward()
    expected = torch.cat([(p - p.grad).detach().flatten() for p in hand.parameters()])
    assert torch.allclose(params(moved), expected, atol=1e-5)
    # tis takes the gradient pass's own logprobs here: one forward, no prepass
    moved.load_state_dict(state)
    tis = RLConfig(micro_batch_size=8, max_grad_norm=1e9,
                   algorithm={**alg, "off_policy": "tis"})
    trainer = PolicyTrainer(moved)
    forwards.clear()
    trainer.optimizer = torch.optim.SGD(moved.parameters(), lr=1.0)
    trainer.rl_step(rollout_at(batch, logp0, 0.0), tis, l_max=8)
    assert len(forwards) == 1


def test_decoupled_clips_against_the_proximal_policy(calc_model_dir):
    # two epochs: epoch 2's ratio is exp(logp - logp_prox), logp_prox the prepass at train start
    # (= logp0 here), NOT the behaviour policy (the engine reported logp0 + 0.3, so w = exp(-0.3))
    batch = clip_batch()
    alg = {"off_policy": "decoupled", "aggregation": "token-mean"}  # ppo_clip 0.2 / 0.2
    with torch.no_grad():
        logp0, _ = token_logprobs(load_model(calc_model_dir), batch)
    behaviour = rollout_at(batch, logp0, 0.3)
    cfg = RLConfig(micro_batch_size=8, max_grad_norm=1e9, ppo_epochs=2, algorithm=alg)
    two, _, metrics = sgd_step(calc_model_dir, behaviour, cfg)
    one, _, _ = sgd_step(calc_model_dir, behaviour,
                         RLConfig(micro_batch_size=8, max_grad_norm=1e9, algorithm=alg))
    mask = batch.loss_mask
    adv = compute_advantages(batch, cfg.algorithm)[0]
    w = math.exp(-0.3)
    logp1, _ = token_logprobs(one, batch)
    ratio = torch.exp(logp1 - logp0)

    def clipped_at(r):
        return (((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))).float() * mask

    clipped = clipped_at(ratio)
    assert 0 < clipped.sum() < mask.sum()
    assert not torch.equal(clipped, clipped_at(ratio * w))  # anchoring on behaviour differs
    (-(w * ratio * adv * mask * (1 - clipped)).sum() / mask.sum()).backward()
    expected = torch.cat([(p - p.grad).detach().flatten() for p in one.parameters()])
    assert torch.allclose(params(two), expected, atol=1e-5)
    assert metrics["clip_frac"] == pytest.approx(float(clipped.sum()) / (2 * float(mask.sum())))
    assert metrics["is_weight_mean"] == pytest.approx(w, abs=1e-6)


def test_off_policy_metrics_on_a_tiny_batch(calc_model_dir):
    # four rows of 3 generated tokens; the engine's logprobs differ from the trainer's by
    # +0.1, -0.2, +0.3, -0.4 per row; rows sampled by versions 3, 1, (unknown), 2 and trained at
    # version 3: staleness 0, 2, -, 1
    batch = clip_batch()
    with torch.no_grad():
        logp, _ = token_logprobs(load_model(calc_model_dir), batch)
    shift = torch.tensor([0.1, -0.2, 0.3, -0.4])[:, None]
    batch.rollout_logprobs = (logp + shift) * batch.loss_mask
    batch.sample_version = torch.tensor([3, 1, -1, 2])
    model = load_model(calc_model_dir)
    trainer = PolicyTrainer(model)
    trainer.set_optimizer(lr=1e-3)
    trainer.version = 3
    cfg = RLConfig(micro_batch_size=8, algorithm={"off_policy": "tis", "is_cap": 1.2})
    m = trainer.rl_step(batch, cfg, l_max=8)
    # rho = exp(logp_old - logp_rollout) per row: exp(-0.1) = 0.904837, exp(0.2) = 1.221403,
    # exp(-0.3) = 0.740818, exp(0.4) = 1.491825; C = 1.2 caps rows 1 and 3
    expected = {
        "logp_mismatch_mean": 0.25, "logp_mismatch_max": 0.4,
        "importance_weight_mean": 1.089721, "importance_weight_max": 1.491825,
        "is_weight_mean": (0.904837 + 1.2 + 0.740818 + 1.2) / 4, "is_weight_max": 1.2,
        "is_truncated_frac": 0.5, "is_masked_frac": 0.0,
        # (2 * 0.2 * 3 + 1 * 0.4 * 3) / (2 * 3 + 1 * 3); fresh: row 0; stale: rows 1 and 3
        "staleness_weighted_mismatch": 2.4 / 9, "mismatch_fresh": 0.1, "mismatch_stale": 0.3,
    }
    assert {k: m[k] for k in expected} == pytest.approx(expected, abs=1e-5)
    # a row sampled by weights newer than the trainer's is a pipeline bug, not a metric
    batch.sample_version = torch.tensor([3, 5, 0, 0])
    with pytest.raises(ValueError, match="sampled by weight version 5, newer than the "
                       "trainer's version 4"):
        trainer.rl_step(batch, cfg, l_max=8)


def test_collate_records_each_rows_oldest_sample_version():
    t = make_traj([3, 4], [5, 6], 1.0)
    rows = [Trajectory(**{**t.__dict__, "versions": (4, 2, 3)}), t,
            Trajectory(**{**t.__dict__, "turn_spans": (), "versions": ()})]
    batch = Batch.collate(rows, 0)
    assert batch.sample_version.tolist() == [2, 0, -1]
    assert batch.rows(torch.tensor([2, 0])).sample_version.tolist() == [-1, 2]


# the extra terms must accumulate like the policy loss: entropy bonus, KL in the loss, the
# off-policy weight (decoupled: with its prepass)
EXTRAS = {
    "plain": {},
    "entropy+kl+tis": {"entropy_coef": 0.01, "kl": {"beta": 0.1}, "off_policy": "tis",
                       "is_cap": 2.0},
    "gspo": {"policy_loss": "gspo"},
    "decoupled": {"off_policy": "decoupled"},
}


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_micro_batching_gives_the_same_update(calc_model_dir, tokenizer, aggregation, extras):
    pad = tokenizer.pad_token_id
    trajs = [make_traj([3, 4, 5, 6][: 2 + i % 3], [7 + i, 8, 9 + i][: 1 + i % 3], float(i % 2),
                       task=f"t{i // 3}") for i in range(6)]
    rewards = [0.5, -1.0, 2.0, -0.3, 0.0, 1.0]  # dr_grpo: A = r - group mean, all nonzero
    ref = load_model(calc_model_dir)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))  # a reference that differs from the policy
    deltas = []
    for micro in (6, 2):
        m = load_model(calc_model_dir)
        before = torch.cat([p.detach().flatten() for p in m.parameters()])
        t = PolicyTrainer(m)
        t.optimizer = torch.optim.SGD(m.parameters(), lr=1.0)  # delta = -gradient
        alg = {"advantage": "dr_grpo", "aggregation": aggregation, **EXTRAS[extras]}
        t.rl_step(Batch.collate(trajs, pad, rewards),
                  RLConfig(micro_batch_size=micro, max_grad_norm=1e9, algorithm=alg), l_max=8,
                  ref_model=copy.deepcopy(ref))
        deltas.append(torch.cat([p.detach().flatten() for p in m.parameters()]) - before)
    assert deltas[0].abs().max() > 1e-6
    assert torch.allclose(deltas[0], deltas[1], atol=1e-6, rtol=1e-4)


def test_sft_step_lowers_loss_on_assistant_tokens_only(model, tokenizer):
    pad = tokenizer.pad_token_id
    traj = make_traj([5, 6, 7, 8], [20, 21, 22], 1.0)
    trainer = PolicyTrainer(model)
    trainer.set_optimizer(lr=5e-3)
    batch = Batch.collate([traj], pad)
    first = trainer.sft_step(batch, micro_batch_size=4)
    for _ in range(5):
        last = trainer.sft_step(batch, micro_batch_size=4)
    assert last["sft_loss"] < first["sft_loss"]
    assert first["tokens"] == 3.0  # the 4 prompt tokens carry no loss


def test_full_weight_update_must_cover_the_model(model):
    engine = EmbeddedEngine(copy.deepcopy(model), 0)
    full = WeightUpdate.full(model, 3).tensors
    name = "model.layers.0.self_attn.q_proj.weight"  # not tied to another tensor
    before = params(engine.model)
    shape = tuple(full[name][:-1].shape)
    bad = [  # (tensors, what the one-line error must say)
        ({k: v for k, v in full.items() if k != name}, f"missing tensors (a full update must "
         f"cover the model; pass partial=True for a subset): {name}"),
        ({**full, "extra.weight": torch.zeros(1)}, "tensors the model lacks: extra.weight"),
        ({**full, name: full[name][:-1]}, f"shape mismatch: {name} {shape} vs the model's"),
    ]
    for tensors, words in bad:
        with pytest.raises(WeightSyncError) as e:
            engine.update_weights(WeightUpdate(3, tensors))
        assert str(e.value).startswith("weight update v3 does not fit the model: ")
        assert words in str(e.value) and "\n" not in str(e.value)
        assert engine.version == 0 and torch.equal(params(engine.model), before)
    # a subset is fine when the update says it is one; the other tensors stay as they were
    changed = full[name] + 1.0
    engine.update_weights(WeightUpdate(4, {name: changed}, partial=True))
    assert engine.version == 4 and torch.equal(engine.model.state_dict()[name], changed)
    others = {k: v for k, v in engine.model.state_dict().items() if k != name}
    assert all(torch.equal(v, full[k]) for k, v in others.items())
    with pytest.raises(WeightSyncError, match="tensors the model lacks: nope"):
        engine.update_weights(WeightUpdate(5, {"nope": changed}, partial=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (model.device=cuda)")
def test_generate_and_rl_step_on_cuda(calc_model_dir):
    # engine, trainer, reference and critic on the GPU; the engine's logprobs of what it
    # sampled agree with the trainer's recomputation on the same device
    model = load_model(calc_model_dir).to("cuda")
    engine = EmbeddedEngine(copy.deepcopy(model), 0)
    prompt = [3, 4, 5, 6]
    params_ = SamplingParams(max_new_tokens=8, stop_token_ids=(-1,))  # sample all 8
    trajs = []
    for k in range(4):
        gen = asyncio.run(engine.generate(prompt, params_, seed=k))
        t = make_traj(prompt, gen.token_ids, float(k % 2))
        trajs.append(Trajectory(**{**t.__dict__, "logprobs": (0.0,) * 4 + tuple(gen.logprobs)}))
    cfg = RLConfig(micro_batch_size=2, ppo_epochs=2, mini_batches=2,
                   algorithm={"preset": "ppo"})
    def step(model):
        trainer = PolicyTrainer(model)
        trainer.set_optimizer(lr=1e-3)
        critic = Critic(model, cfg.algorithm.critic)
        m = trainer.rl_step(Batch.collate(trajs, 0), cfg, l_max=8,
                            ref_model=copy.deepcopy(model), critic=critic)
        return trainer, critic, m

    _, _, on_cpu = step(load_model(calc_model_dir))  # the same update, computed on the CPU
    trainer, critic, m = step(model)
    assert m["logp_mismatch_max"] < 1e-3
    assert m["loss"] == pytest.approx(on_cpu["loss"], rel=1e-3, abs=1e-5)
    assert m["clip_frac"] == pytest.approx(on_cpu["clip_frac"], abs=0.05)
    assert trainer.version == 4 and critic.device.type == "cuda"
    engine.update_weights(trainer.weight_update())
    assert engine.version == 4


def test_sft_loss_is_at_temperature_one(calc_model_dir):
    # SFT fits the data's likelihood; the sampling temperature (the RL trainer's) must not enter
    batch = Batch.collate([make_traj([5, 6, 7, 8], [20, 21, 22], 1.0)], 0)
    losses = []
    for temperature in (1.0, 0.5):
        trainer = PolicyTrainer(load_model(calc_model_dir), temperature=temperature)
        trainer.set_optimizer(lr=1e-3)
        losses.append(trainer.sft_step(batch, micro_batch_size=1)["sft_loss"])
    with torch.no_grad():
        logp, _ = token_logprobs(load_model(calc_model_dir), batch, 1.0)
    assert losses[0] == losses[1] == pytest.approx(-float((logp * batch.loss_mask).sum()) / 3)


# ---- issue 19: dropout off in the gradient passes ----------------------------------------------

def gpt2_with_dropout(p: float = 0.3):
    """A GPT-2-style model built here: random weights, dropout p on embeddings, attention and
    residuals (as GPT-2, OPT and Phi ship)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2,
                                      n_head=2, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p))


def engine_batch(model):
    """Two groups of two rows of 8 tokens, with the logprobs an engine (eval mode) reports."""
    trajs = [make_traj([1, 2, 3, 4], [5 + i, 6 + 2 * i, 7 + i, 8], float(i % 2), task=f"t{i // 2}")
             for i in range(4)]
    batch = Batch.collate(trajs, 0)
    with torch.no_grad():
        logp, _ = token_logprobs(model.eval(), batch)
    return rollout_at(batch, logp, 0.0)


def pass_logprobs(logits, batch):
    """The logprobs of the batch's ids from one forward pass's logits."""
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    return lp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("dropout", ["off", "keep"])
def test_dropout_off_makes_the_ratio_exactly_1_before_the_update(dropout):
    model = gpt2_with_dropout()
    batch = engine_batch(model)
    logits = []
    trainer = PolicyTrainer(model) if dropout == "off" else PolicyTrainer(model, dropout="keep")
    # each pass's logits, from the transformer's output with the weights of that moment
    model.transformer.register_forward_hook(
        lambda _m, _i, out: logits.append(model.lm_head(out.last_hidden_state).detach()))
    trainer.set_optimizer(lr=1e-2)
    cfg = RLConfig(micro_batch_size=8, ppo_epochs=2, algorithm={"off_policy": "tis"})
    trainer.rl_step(batch, cfg, l_max=8)
    # passes: logp_old's no-grad prepass, epoch 1 (the weights have not moved yet), epoch 2
    assert len(logits) == 3
    on = batch.loss_mask[:, 1:] > 0
    rho = torch.exp(pass_logprobs(logits[1], batch) - pass_logprobs(logits[0], batch))[on]
    if dropout == "off":
        assert torch.equal(rho, torch.ones_like(rho))
    else:  # dropout on in the gradient pass: a ratio off 1 with no update at all
        assert (rho - 1).abs().max() > 0.05
    # one optimizer step without a prepass: logp_old is the gradient pass's own logprobs,
    # which with dropout off are the engine's exactly (no spurious mismatch, TIS weight 1)
    model = gpt2_with_dropout()
    batch = engine_batch(model)
    trainer = PolicyTrainer(model) if dropout == "off" else PolicyTrainer(model, dropout="keep")
    trainer.set_optimizer(lr=1e-2)
    m = trainer.rl_step(batch, RLConfig(micro_batch_size=8, algorithm={"off_policy": "tis"}),
                        l_max=8)
    if dropout == "off":
        assert (m["logp_mismatch_max"], m["is_weight_mean"], m["is_weight_max"]) == (
            0.0, 1.0, 1.0)
    else:
        assert m["logp_mismatch_max"] > 0.05


def test_dropout_rates_and_keep_on_a_model_without_dropout(calc_model_dir, tmp_path):
    from tiller.config import load_config
    from tiller.models import dropout_rates
    from tiller.run import Run

    rates = dropout_rates(gpt2_with_dropout(0.3))
    assert rates["transformer.drop"] == 0.3 and rates["transformer.h.0.attn.attn_dropout"] == 0.3
    assert set(rates.values()) == {0.3} and len(rates) == 1 + 2 * 3  # embd + (attn, resid x2)
    assert dropout_rates(load_model(calc_model_dir)) == {}  # the built Qwen3: no dropout
    cfg = load_config("configs/calculator.yaml", [f"model.path={calc_model_dir}",
                                                  "model.build=null", "model.dropout=keep",
                                                  "logging.tensorboard=false"])
    with pytest.raises(ConfigError, match=r"^config field model.dropout: got 'keep'; this model "
                                          r"has no dropout"):
        Run(cfg, tmp_path / "run")


# ---- issue 19: the trainer recomputes the truncated distribution the engine sampled ---------

class MaskedVocab(torch.nn.Module):
    """Logits from an embedding, with the vocabulary entries in `masked` at -inf (a model that
    masks part of its vocabulary), shaped like a causal LM: the transformer (`base_model`,
    here the model itself) returns the embedding as its last hidden state and the output
    layer adds the mask."""

    config = SimpleNamespace()

    def __init__(self, vocab: int, masked: list[int]):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, vocab)
        torch.nn.init.normal_(self.embed.weight, generator=torch.Generator().manual_seed(6))
        self.register_buffer("mask", torch.zeros(vocab).index_fill_(0, torch.tensor(masked),
                                                                     float("-inf")))

    @property
    def base_model(self) -> torch.nn.Module:
        return self

    def get_output_embeddings(self):
        return lambda hidden: hidden + self.mask

    def forward(self, input_ids: torch.Tensor, **_) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=self.embed(input_ids))


@pytest.mark.parametrize("top_k", [0, 12])  # untruncated; top_k above the 9 finite logits
def test_entropy_of_masked_logits_is_finite_with_finite_gradients(top_k):
    """-inf logits (a masked vocabulary) made the entropy and its gradient NaN (0 * -inf),
    untruncated and with top_k reaching them; with 0 log 0 := 0 both equal the entropy of the
    finite logits alone."""
    vocab, masked = 12, [1, 4, 10]
    finite = [v for v in range(vocab) if v not in masked]
    model = MaskedVocab(vocab, masked)
    ids = torch.tensor([[0, 2, 3, 5, 6], [7, 8, 9, 11, 0]])
    batch = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids))
    _, ent = token_logprobs(model, batch, 0.7, with_entropy=True, top_k=top_k)
    ent.sum().backward()
    grad = model.embed.weight.grad
    ref = copy.deepcopy(model)
    ref.embed.weight.grad = None
    logits = ref.embed(ids[:, :-1])[..., finite] / 0.7  # the finite logits alone
    q = torch.softmax(logits, -1)
    ref_ent = -(q * torch.log_softmax(logits, -1)).sum(-1)
    ref_ent.sum().backward()
    assert torch.isfinite(ent).all() and torch.isfinite(grad).all()
    assert torch.allclose(ent[:, 1:], ref_ent, atol=1e-6) and float(ent[:, 1:].detach().min()) > 0.1
    assert torch.allclose(grad, ref.embed.weight.grad, atol=1e-6)
    assert float(grad.abs().sum()) > 0.1


def test_trainer_logprobs_are_of_the_truncated_distribution(model):
    batch = clip_batch()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits[:, :-1].float()
        full, _ = token_logprobs(model, batch, temperature=0.7)
        trunc, ent = token_logprobs(model, batch, 0.7, with_entropy=True, top_k=3)
    # by hand: renormalised over the 3 most likely tokens (plus the token itself)
    logp = torch.log_softmax(logits / 0.7, -1)
    top = torch.topk(logp, 3, -1).indices
    keep = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, top, True)
    ids = batch.input_ids[:, 1:, None]
    norm = torch.logsumexp(logp.masked_fill(~keep.scatter(-1, ids, True), float("-inf")), -1)
    hand = logp.gather(-1, ids)[..., 0] - norm
    assert torch.allclose(trunc[:, 1:], hand, atol=1e-5)
    assert torch.allclose(full[:, 1:], logp.gather(-1, ids)[..., 0], atol=1e-5)
    assert (trunc[:, 1:] > full[:, 1:] + 1e-3).any()  # the kept mass is below 1
    q = torch.softmax(logp.masked_fill(~keep, float("-inf")), -1)  # entropy of the top 3
    h = -(q * torch.log(q.clamp_min(1e-30))).sum(-1)
    assert torch.allclose(ent[:, 1:], h, atol=1e-5) and float(ent[:, 1:].max()) <= math.log(3)
    # the trainer's passes use the sampler's truncation: with the engine's sampled logprobs
    # the ratio to the behaviour policy is 1 on-policy
    on_policy = rollout_at(batch, trunc, 0.0)
    trainer = PolicyTrainer(model, temperature=0.7, top_k=3)
    trainer.set_optimizer(lr=1e-3)
    m = trainer.rl_step(on_policy, RLConfig(micro_batch_size=8, algorithm={"off_policy": "tis"}),
                        l_max=8)
    assert m["logp_mismatch_max"] < 1e-5 and m["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
