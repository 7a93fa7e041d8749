"""Episodes split into several exact sequences (`TrajectoryBuilder.start_segment`): each
sequence is its own batch row, seeing only its own tokens, and every row of an episode gets the
advantage the episode has in its group."""

import pytest
import torch

from tiller.config import RLConfig
from tiller.envs.verifiers import Reward
from tiller.rollout.trajectory import Status, TrajectoryBuilder
from tiller.train.batch import Batch
from tiller.train.logprobs import token_logprobs
from tiller.train.shaping import rl_batch
from tiller.train.trainer import PolicyTrainer, compute_advantages


def split_episode(reward: float, task: str = "t", reason: str = "template_history"):
    """prompt [1 2 3] + turn [4 5] + obs [6], then a new context [1 2 7] + turn [8 9 10]."""
    b = TrajectoryBuilder(task)
    b.append_prompt([1, 2, 3])
    b.append_generated([4, 5], [-0.5, -0.25], 0)
    b.append_observation([6])
    assert b.token_ids == [1, 2, 3, 4, 5, 6] and len(b) == 6
    b.start_segment([1, 2, 7], reason)
    assert b.token_ids == [1, 2, 7] and len(b) == 3  # the next turn's context only
    b.append_generated([8, 9, 10], [-1.0, -2.0, -3.0], 1)
    return b.finish(Reward(reward), Status.COMPLETED)


def whole_episode(reward: float, task: str = "t"):
    b = TrajectoryBuilder(task)
    b.append_prompt([1, 2, 3])
    b.append_generated([4, 5, 8], [-0.5, -0.25, -1.0], 0)
    return b.finish(Reward(reward), Status.COMPLETED)


def test_a_split_trajectory_keeps_every_token_flat_and_names_its_sequences():
    t = split_episode(1.0)
    assert t.token_ids == (1, 2, 3, 4, 5, 6, 1, 2, 7, 8, 9, 10)
    assert t.loss_mask == (0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1)
    assert t.logprobs[9:] == (-1.0, -2.0, -3.0)
    assert t.segment_starts == (6,) and t.split_reasons == ("template_history",)
    assert t.segments() == [(0, 6), (6, 12)]
    assert t.turn_spans == ((3, 5), (9, 12)) and t.versions == (0, 1)
    assert t.num_generated == 5 and t.prompt_len == 3
    assert whole_episode(0.0).segments() == [(0, 6)]


def test_start_segment_needs_a_turn_before_it_and_ids():
    b = TrajectoryBuilder("t")
    b.append_prompt([1, 2])
    with pytest.raises(ValueError, match="before any generated turn"):
        b.start_segment([1], "x")
    b.append_generated([3], [0.0], 0)
    with pytest.raises(ValueError, match="context ids"):
        b.start_segment([], "x")


def test_collate_gives_each_sequence_its_own_row():
    batch = Batch.collate([split_episode(1.0), whole_episode(0.0)], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 9, 10],
                                         [1, 2, 3, 4, 5, 8]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1],
                                        [0, 0, 0, 1, 1, 1]]
    assert batch.rollout_logprobs[1, 3:].tolist() == [-1.0, -2.0, -3.0]
    assert batch.episode_index.tolist() == [0, 0, 1]
    assert batch.group_index.tolist() == [0, 0, 0]  # one task: one group
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0]
    assert batch.turn_spans == (((3, 5),), ((3, 6),), ((3, 6),))
    assert batch.sample_version.tolist() == [0, 0, 0]


def test_a_split_episode_is_one_sample_of_its_group():
    # group rewards [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3); A = (1 - 1/3) / 0.57735 =
    # 1.154701 and (0 - 1/3) / 0.57735 = -0.577350, whether or not episode 0 is split
    alg = RLConfig().algorithm
    trajs = [split_episode(1.0), whole_episode(0.0), whole_episode(0.0)]
    adv, _ = compute_advantages(Batch.collate(trajs, 0), alg)
    assert torch.allclose(adv[0], torch.tensor([0, 0, 0, 1.154701, 1.154701, 0]), atol=1e-5)
    assert torch.allclose(adv[1], torch.tensor([0, 0, 0, 1.154701, 1.154701, 1.154701]),
                          atol=1e-5)
    assert torch.allclose(adv[2:, 3:], torch.full((2, 3), -0.577350), atol=1e-5)
    unsplit, _ = compute_advantages(Batch.collate([whole_episode(1.0), *trajs[1:]], 0), alg)
    assert torch.equal(adv[1:], unsplit)


@pytest.mark.parametrize("algorithm", [{"advantage": "gae"}, {}])
def test_per_token_or_per_turn_rewards_over_split_episodes_are_refused(algorithm):
    trajs = [split_episode(1.0), whole_episode(0.0)]
    if algorithm:  # gae: a per-token estimator
        with pytest.raises(ValueError, match="split into several sequences"):
            compute_advantages(Batch.collate(trajs, 0), RLConfig(algorithm=algorithm).algorithm)
    else:  # turn-level credit from per-turn rewards
        from dataclasses import replace
        trajs[0] = replace(trajs[0], reward=Reward(1.0, turn_rewards=(0.5, 0.0)))
        with pytest.raises(ValueError, match="per-turn rewards"):
            Batch.collate(trajs, 0)


def test_each_row_is_scored_on_its_own_sequence_and_trains(model, tokenizer):
    """The trainer's logprobs of the second sequence are those of that sequence alone (the
    first sequence is not its context), and an RL step moves the weights."""
    trajs = [split_episode(1.0), whole_episode(0.0)]
    cfg = RLConfig(tasks_per_step=1, group_size=2, lr=1e-2)
    batch, stats = rl_batch(trajs, torch.tensor([0, 0]), [1.0, 0.0], tokenizer.pad_token_id,
                            cfg.algorithm, 0.0)
    assert stats["split_episodes"] == 1 and stats["segments_per_episode"] == 1.5
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
        alone, _ = token_logprobs(model, Batch.collate([whole_episode(1.0)], 0))
        second = Batch.collate([whole_episode(1.0)], 0)
        second.input_ids[0] = torch.tensor([1, 2, 7, 8, 9, 10])
        own, _ = token_logprobs(model, second)
    assert torch.allclose(logp[1], own[0], atol=1e-6)
    assert torch.allclose(logp[2], alone[0], atol=1e-6)
    trainer = PolicyTrainer(model)
    trainer.set_optimizer(lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    m = trainer.rl_step(batch, cfg, l_max=8)
    assert m["grad_norm"] > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
