"""Trainer ranks under model.lora: every rank holds the frozen base and its own adapters
(rank 0's, broadcast at start), the adapters' gradients summed over the ranks; 2 ranks equal
1 rank on the same batch for SFT and for an RL step with the KL reference (the frozen
'reference' adapter) and PPO's critic (sharded with FSDP2)."""

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from test_distributed import ATOL, batch_of, flat
from test_distributed_rl import STATS, assert_same, same
from test_lora import LORA, lora_of

from tiller.config import RLConfig
from tiller.train.distributed import LoraLeader, TrainerOptions
from tiller.train.lora import Lora, LoraTrainer
from tiller.train.ranks import start_ranks


@pytest.fixture(scope="module")
def group(calc_model_dir):
    lora = lora_of(calc_model_dir)
    torch.manual_seed(1)  # rank 1's own adapters start elsewhere: the broadcast makes them rank 0's
    leader = start_ranks(lora.merged, 2, TrainerOptions(), "local", 120.0, lora=lora)
    yield leader
    leader.close()


def pair(group: LoraLeader, calc_model_dir, lr=1e-2):
    """A single-rank LoRA trainer at the group's adapters, and the group, each with a fresh
    optimizer."""
    lora = lora_of(calc_model_dir)
    set_peft_model_state_dict(lora.policy, get_peft_model_state_dict(group.lora.policy))
    lora.merge()
    single = LoraTrainer(lora)
    for t in (single, group):
        t.set_optimizer(lr)
    return single, group


def adapters(lora: Lora) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for n, p in lora.policy.named_parameters()
                      if ".lora_" in n and ".default." in n])


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_two_lora_ranks_equal_one_rank_on_an_sft_step(group, calc_model_dir, tokenizer):
    batch = batch_of(tokenizer)
    single, group = pair(group, calc_model_dir)
    assert isinstance(group, LoraLeader) and group.lora.cfg == LORA
    trainable = sum(p.numel() for g in group.optimizer.param_groups for p in g["params"])
    assert trainable == group.lora.trainable()  # the frozen base is not in the optimizer
    before = adapters(single.lora)
    want = single.sft_step(batch, micro_batch_size=2)
    got = group.sft_step(batch, 2)
    assert got["sft_loss"] == pytest.approx(want["sft_loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert (adapters(group.lora) - before).abs().max() > 1e-4  # the adapters moved
    assert torch.allclose(adapters(group.lora), adapters(single.lora), atol=ATOL)
    # what weight sync reads: rank 0's merged model, no gather
    assert group.publisher.model is group.lora.merged
    assert torch.allclose(flat(group.lora.merged), flat(single.lora.merged), atol=ATOL)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_two_lora_ranks_equal_one_rank_with_the_reference_adapter_and_a_critic(
        group, calc_model_dir, tokenizer):
    """The reference adapter is frozen at the current adapters (on each rank), an SFT step
    moves the policy off it, then a PPO step (critic + GAE) with the KL in the loss."""
    batch = batch_of(tokenizer)
    single, group = pair(group, calc_model_dir)
    cfg = RLConfig(micro_batch_size=2, mini_batches=2, max_grad_norm=0.5, algorithm={
        "preset": "ppo", "kl": {"beta": 0.5, "placement": "loss", "estimator": "k3"},
        "critic": {"value_lr": 1e-3}})
    refs = [t.reference() for t in (single, group)]
    assert refs[1] is group.model and group.lora.has_reference()
    critics = [t.new_critic(cfg.algorithm.critic) for t in (single, group)]
    for t in (single, group):
        t.sft_step(batch, 2)
    want = single.rl_step(batch, cfg, 8, refs[0], critics[0])
    got = group.rl_step(batch, cfg, 8, refs[1], critics[1])
    assert want["kl"] > 1e-4
    assert_same(got, want, (*STATS, "kl", "value_loss", "value_grad_norm", "value_clip_frac"))
    assert torch.allclose(adapters(group.lora), adapters(single.lora), atol=ATOL)
    state = group.critic_state()
    gathered = torch.cat([state[k].flatten() for k, _ in critics[0].model.named_parameters()])
    assert torch.allclose(gathered, flat(critics[0].model), atol=ATOL)
    group.drop_reference()
    assert not group.lora.has_reference()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_lora_ranks_optimizer_reference_adapter_and_critic_round_trip(
        group, calc_model_dir, tokenizer, tmp_path):
    """A checkpoint's share of the LoRA ranks (`checkpoint_state`): the adapters' optimizer
    state (keyed by parameter name) and PPO's critic; the reference adapter is rank 0's, which
    the checkpoint's adapter/ folder holds. Put back into ranks whose optimizers, critic and
    reference adapters have moved on since (rank 0's reference adapter loaded from the saved
    folder first, as a resume does), they gather again bit for bit the same, and every rank's
    reference adapter is the saved one: an RL step's KL (taken before the update) equals a
    single rank's at the same adapters and reference."""
    batch = batch_of(tokenizer)
    group.set_optimizer(1e-2)
    cfg = RLConfig(micro_batch_size=2, mini_batches=2, max_grad_norm=0.5, algorithm={
        "preset": "ppo", "kl": {"beta": 0.5, "placement": "loss", "estimator": "k3"},
        "critic": {"value_lr": 1e-3}})
    group.reference()
    critic = group.new_critic(cfg.algorithm.critic)
    group.sft_step(batch, 2)
    group.rl_step(batch, cfg, 8, group.model, critic, 0)
    saved, rngs = group.checkpoint_state()
    assert sorted(saved) == ["critic", "critic_optimizer", "optimizer"]
    assert set(saved["optimizer"]["state"]) == {n for n, p in group.model.named_parameters()
                                                if p.requires_grad}
    group.lora.save(tmp_path / "adapter")
    group.rl_step(batch, cfg, 8, group.model, critic, 1)  # the optimizers and critic move on
    group.reference()  # every rank's reference adapter := its adapters now
    group.lora.load_reference(tmp_path / "adapter")
    group.load_checkpoint_state(saved, [None, rngs[1]], version=3)
    again, _ = group.checkpoint_state()
    assert same(again, saved)
    single, group = pair(group, calc_model_dir)
    single.lora.load_reference(tmp_path / "adapter")
    kl = RLConfig(micro_batch_size=2, mini_batches=1, algorithm={
        "advantage": "dr_grpo", "kl": {"beta": 0.5, "placement": "loss", "estimator": "k3"}})
    want = single.rl_step(batch, kl, 8, single.model)
    got = group.rl_step(batch, kl, 8, group.model)
    assert want["kl"] > 1e-4 and got["kl"] == pytest.approx(want["kl"], rel=1e-5)
    group.drop_reference()
