"""Trainer ranks (`train.world_size`) with the KL reference model and PPO's critic: 2 FSDP2
ranks equal 1 rank on the same batch (loss, KL, value loss, grad norms, updated policy and
critic weights). Each rank holds its own reference model and critic, sharded like the policy
(`train.distributed`)."""

import copy

import pytest
import torch
from test_distributed import ATOL, REL, assert_same_weights, batch_of, flat

from tiller.config import RLConfig
from tiller.models import load_model
from tiller.train.distributed import TrainerOptions
from tiller.train.ranks import start_ranks
from tiller.train.trainer import PolicyTrainer

# the same keys to the same tolerance as tests/test_distributed.py's RL steps
STATS = ("loss", "grad_norm", "entropy", "clip_frac", "logp_mismatch_mean",
         "advantage_abs_mean")


@pytest.fixture(scope="module")
def group(calc_model_dir):
    """Rank 0 here and rank 1 in a spawned process, over one gloo group."""
    torch.manual_seed(0)
    leader = start_ranks(load_model(calc_model_dir), 2, TrainerOptions(), "local", 120.0)
    yield leader
    leader.close()


def pair(group, lr=1e-3):
    """A single-rank trainer at the group's current weights, and the group, each with a fresh
    optimizer."""
    single = PolicyTrainer(copy.deepcopy(group.publisher.model))
    for t in (single, group):
        t.set_optimizer(lr)
    return single, group


def assert_same(got, want, keys):
    """REL for the policy's metrics; the critic's (value_*), whose passes run every position
    as before, measured within 1.4e-7 relative of 1 rank: 1e-5."""
    for key in keys:
        rel = 1e-5 if key.startswith("value_") else REL
        assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-7), key


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_two_ranks_equal_one_rank_with_the_kl_term(group, tokenizer, placement):
    """The reference is made at the current weights (each rank its own shards), then an SFT
    step moves the policy off it, so the RL step's KL is well above 0 from its first pass."""
    batch = batch_of(tokenizer)
    single, group = pair(group)
    refs = [t.reference() for t in (single, group)]
    assert all(not p.requires_grad for p in refs[1].parameters())
    # sharded, not replicated: rank 0 holds about half of every tensor (dim 0 cut in two)
    held = sum(p.to_local().numel() for p in refs[1].parameters())
    whole = sum(p.numel() for p in refs[0].parameters())
    assert whole / 2 <= held < 0.51 * whole
    for t in (single, group):
        t.sft_step(batch, 2)
    cfg = RLConfig(micro_batch_size=2, mini_batches=2, max_grad_norm=0.5, algorithm={
        "advantage": "dr_grpo", "kl": {"beta": 0.5, "placement": placement,
                                       "estimator": "k3" if placement == "loss" else None}})
    before = flat(single.model)
    want = single.rl_step(batch, cfg, 8, ref_model=refs[0])
    got = group.rl_step(batch, cfg, 8, ref_model=refs[1])
    assert want["kl"] > 1e-3
    assert_same(got, want, (*STATS, "kl", "kl_beta"))
    after = flat(group.publisher.model)
    assert (after - before).abs().max() > 1e-4  # the weights moved
    assert_same_weights(after, single.model, single.optimizer)
    group.drop_reference()
    assert group.ref is None


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_rank_0s_empty_pass_leaves_its_rows_alone(group, tokenizer, placement):
    """3 rows at 1 row a pass: rank 0 holds the shortest row (the one an empty pass runs on,
    marked by a negative index) and 1 row to rank 1's 2, so it runs an empty pass in the
    reference pass and in the pass that fills logp_old (KL in the loss: the gradient pass; in
    the reward: the prepass). Neither may write that row: with the output layer on the loss
    positions only, the empty pass's values are 0 there. The short row's advantage is not 0
    (rewards 1, -1, 2), so its logp_old and reference logprobs reach the loss."""
    batch = batch_of(tokenizer, n=3, rewards=(1.0, -1.0, 2.0))
    single, group = pair(group)
    refs = [t.reference() for t in (single, group)]
    for t in (single, group):
        t.sft_step(batch, 2)  # off the reference
    cfg = RLConfig(micro_batch_size=1, mini_batches=1, max_grad_norm=0.5, algorithm={
        "advantage": "dr_grpo", "kl": {"beta": 0.5, "placement": placement,
                                       "estimator": "k3" if placement == "loss" else None}})
    want = single.rl_step(batch, cfg, 8, ref_model=refs[0])
    got = group.rl_step(batch, cfg, 8, ref_model=refs[1])
    assert want["kl"] > 1e-3 and single.last_rl.advantages[0].abs().max() > 0.1
    assert_same(got, want, (*STATS, "kl"))
    # on the mask, tight: logp_old, and (KL in the reward) the advantages the reference's
    # logprobs went into
    mask = batch.loss_mask
    for name in ("logp_old", "advantages"):
        gap = (getattr(group.last_rl, name) - getattr(single.last_rl, name)) * mask
        assert gap.abs().max() < 1e-5, name
    group.drop_reference()


def ppo_pair(group, tokenizer):
    """The batch, a single rank and the group (`pair`), PPO's config with the KL term, and each
    trainer's reference model and critic."""
    batch = batch_of(tokenizer)
    single, group = pair(group)
    cfg = RLConfig(micro_batch_size=2, mini_batches=2, max_grad_norm=0.5, algorithm={
        "preset": "ppo", "kl": {"beta": 0.1}, "critic": {"value_lr": 1e-3}})
    refs = [t.reference() for t in (single, group)]
    critics = [t.new_critic(cfg.algorithm.critic) for t in (single, group)]
    return batch, single, group, cfg, refs, critics


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_two_ranks_equal_one_rank_with_a_critic_and_kl(group, tokenizer):
    """PPO (critic + GAE, KL in the reward) for two RL steps: the second step's values come
    from the critic the first trained (its value mean and explained variance compare them),
    and the critic's gathered weights equal the single rank's after both."""
    batch, single, group, cfg, refs, critics = ppo_pair(group, tokenizer)
    start = flat(critics[0].model)
    for step in range(2):
        want = single.rl_step(batch, cfg, 8, refs[0], critics[0], step)
        got = group.rl_step(batch, cfg, 8, refs[1], critics[1], step)
        assert_same(got, want, (*STATS, "kl", "value_loss", "value_grad_norm",
                                "value_clip_frac", "value_mean"))
        if step == 1:
            assert want["explained_variance"] != 0.0  # the head is no longer zero
            assert got["explained_variance"] == pytest.approx(want["explained_variance"],
                                                              rel=1e-4)
    assert_same_weights(flat(group.publisher.model), single.model, single.optimizer)
    state = group.critic_state()
    trained = dict(critics[0].model.named_parameters())
    assert sorted(state) == sorted(trained)
    gathered = torch.cat([state[k].flatten() for k in trained])
    assert (gathered - start).abs().max() > 1e-4  # the critic moved
    assert_same_weights(gathered, critics[0].model, critics[0].optimizer)


def same(a, b) -> bool:
    """`a` and `b` (state dicts, nested) equal bit for bit, tensor by tensor."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_ranks_reference_model_and_critic_round_trip(group, tokenizer):
    """A checkpoint's share of the ranks with the KL reference model and PPO's critic
    (`checkpoint_state`): trainer.pt's parts, the reference model's and the critic's weights
    whole under a single rank's names and equal to its (the format does not depend on
    train.world_size). Put back (`load_checkpoint_state`) into ranks whose optimizers, critic
    and reference model have moved on since, they gather again bit for bit the same."""
    batch, single, group, cfg, refs, critics = ppo_pair(group, tokenizer)
    for t, ref, critic in zip((single, group), refs, critics, strict=True):
        t.rl_step(batch, cfg, 8, ref, critic, 0)
    saved, rngs = group.checkpoint_state()
    assert sorted(saved) == ["critic", "critic_optimizer", "optimizer", "ref"]
    for name, model in (("ref", refs[0]), ("critic", critics[0].model)):
        want = model.state_dict()
        assert saved[name].keys() == want.keys(), name
        assert all(torch.allclose(saved[name][k], want[k], atol=ATOL) for k in want), name
    assert set(saved["critic_optimizer"]["state"]) == set(dict(critics[0].model
                                                               .named_parameters()))
    group.rl_step(batch, cfg, 8, refs[1], critics[1], 1)  # the optimizers and critic move on
    refs[1].reshard()  # (its forward passes left the root's parameters whole)
    with torch.no_grad():
        for p in refs[1].parameters():
            p.to_local().add_(1.0)
    group.load_checkpoint_state(saved, [None, rngs[1]], version=3)
    again, _ = group.checkpoint_state()
    assert same(again, saved)
    group.drop_reference()
