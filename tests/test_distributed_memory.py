"""Trainer ranks with the memory options (`train.packing`, `train.micro_batch_tokens`,
`train.activation_checkpointing` in `TrainerOptions.train`): 2 FSDP2 ranks that pack, cut by a
token budget and recompute their layers equal 1 rank with the same options on the same batch
(that 1 rank equals a padded one to float rounding: tests/test_trainer_memory.py)."""

import copy

import pytest
import torch
from test_distributed import REL, assert_same_rl_step, assert_same_weights, batch_of, flat

from tiller.config import RLConfig, TrainConfig
from tiller.models import load_model
from tiller.train.distributed import TrainerOptions
from tiller.train.ranks import start_ranks
from tiller.train.trainer import PolicyTrainer

# 9 tokens: batch_of's rows are 4 to 8 tokens long, so some passes pack two rows, some one
KNOBS = TrainConfig(packing=True, micro_batch_tokens=9, activation_checkpointing=True,
                    logprob_chunk_tokens=3)


@pytest.fixture(scope="module")
def group(calc_model_dir):
    torch.manual_seed(0)
    leader = start_ranks(load_model(calc_model_dir), 2, TrainerOptions(train=KNOBS), "local",
                         120.0)
    yield leader
    leader.close()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_packed_budgeted_ranks_equal_one_rank(group, tokenizer):
    batch = batch_of(tokenizer)
    single = PolicyTrainer(copy.deepcopy(group.publisher.model), train=KNOBS)
    for t in (single, group):
        t.set_optimizer(1e-3)
    want = single.sft_step(batch, micro_batch_size=4)
    got = group.sft_step(batch, 4)
    assert got["sft_loss"] == pytest.approx(want["sft_loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    cfg = RLConfig(micro_batch_size=4, mini_batches=2, max_grad_norm=0.5,
                   algorithm={"advantage": "dr_grpo", "aggregation": "seq-mean-token-mean"})
    before = flat(single.model)
    assert_same_rl_step(single, group, batch, cfg, before)  # weights: measured 6.6e-6


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_packed_budgeted_ranks_equal_one_rank_with_reference_and_critic(group, tokenizer):
    """PPO (critic + GAE) with the KL in the loss under the same options: the sharded reference
    and critic pack, cut by the token budget and (the critic) recompute their layers like the
    policy, and 2 ranks still equal 1."""
    batch = batch_of(tokenizer)
    single = PolicyTrainer(copy.deepcopy(group.publisher.model), train=KNOBS)
    for t in (single, group):
        t.set_optimizer(1e-3)
    cfg = RLConfig(micro_batch_size=4, mini_batches=2, max_grad_norm=0.5, algorithm={
        "preset": "ppo", "kl": {"beta": 0.5, "placement": "loss", "estimator": "k3"},
        "critic": {"value_lr": 1e-3}})
    refs = [t.reference() for t in (single, group)]
    critics = [t.new_critic(cfg.algorithm.critic) for t in (single, group)]
    for t in (single, group):
        t.sft_step(batch, 4)
    want = single.rl_step(batch, cfg, 8, refs[0], critics[0])
    got = group.rl_step(batch, cfg, 8, refs[1], critics[1])
    assert want["kl"] > 1e-3
    for key in ("loss", "grad_norm", "kl", "value_loss", "value_grad_norm", "value_clip_frac"):
        rel = 1e-5 if key.startswith("value_") else REL  # the critic: as before (1.4e-7)
        assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-7), key
    assert_same_weights(flat(group.publisher.model), single.model, single.optimizer)
    state = group.critic_state()
    gathered = torch.cat([state[k].flatten() for k, _ in critics[0].model.named_parameters()])
    assert_same_weights(gathered, critics[0].model, critics[0].optimizer)
