import copy

import pytest
import torch

from tiller.config import RLConfig
from tiller.envs.verifiers import Reward
from tiller.rollout.trajectory import Status, Trajectory
from tiller.train.algorithms import ADVANTAGES, AGGREGATIONS
from tiller.train.batch import Batch, token_logprobs
from tiller.train.trainer import Trainer


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
    trainer = Trainer(model)
    trainer.set_optimizer(lr=1e-3)
    # rewards 1 and 0 in one group (same task id): grpo advantages +-0.707
    metrics = trainer.rl_step(Batch.collate(trajs, pad), RLConfig(micro_batch_size=1), l_max=64)
    after = [seq_logprob(model, t, pad) for t in trajs]
    assert after[0] > before[0] and after[1] < before[1]
    assert trainer.version == 1
    assert metrics["logp_mismatch_max"] < 1e-4  # the supplied logprobs were the policy's own
    assert metrics["clip_frac"] == 0.0  # one on-policy mini-batch never clips


# the extra terms must accumulate like the policy loss: entropy bonus, KL in the loss, TIS
EXTRAS = {
    "plain": {},
    "entropy+kl+tis": {"entropy_coef": 0.01, "kl": {"beta": 0.1}, "tis_c": 2.0},
    "gspo": {"policy_loss": "gspo"},
}


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_micro_batching_gives_the_same_update(calc_model_dir, tokenizer, aggregation, extras):
    from tiller.models import load_model

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
        t = Trainer(m)
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
    trainer = Trainer(model)
    trainer.set_optimizer(lr=5e-3)
    batch = Batch.collate([traj], pad)
    first = trainer.sft_step(batch, micro_batch_size=4)
    for _ in range(5):
        last = trainer.sft_step(batch, micro_batch_size=4)
    assert last["sft_loss"] < first["sft_loss"]
    assert first["tokens"] == 3.0  # the 4 prompt tokens carry no loss
