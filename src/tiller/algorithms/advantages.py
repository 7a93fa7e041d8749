"""Advantage estimators and reward shaping, registered in `ADVANTAGES` with the inputs they take.

Outcome estimators declare `rewards` and `group_index` (plus `eps`, `tokens` if they use them):
`fn(rewards[N], group_index[N], ...) -> [N]`, one scalar per item from its group's rewards.
`group_index[i]` names the group of item i; groups need not be contiguous nor numbered densely.
An item is a trajectory, or one turn of one when the turn-credit wrapper (`credit.turn_credit`)
calls the estimator on per-turn returns; `tokens[i]` is its number of loss tokens.

Per-token estimators declare `token_rewards` (with `values`, `mask`): `gae` is PPO's estimator
with a critic, on [B, T] tensors where `mask` is 1 on generated tokens only, and returns
(advantages, returns).
"""

from __future__ import annotations

import torch

from tiller.algorithms.registry import ADVANTAGES


def _group_stats(rewards: torch.Tensor, group_index: torch.Tensor):
    """Per-trajectory group mean, unbiased group std and group size."""
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    ones = torch.ones_like(rewards)
    size = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, ones)
    total = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, rewards)
    mean = (total / size.clamp(min=1))[group_index]
    sq = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, (rewards - mean) ** 2)
    n = size[group_index]
    std = (sq[group_index] / (n - 1).clamp(min=1)).sqrt()
    return mean, std, n


def _weighted_whiten(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mu) / (sigma + eps) with weighted mean mu = sum w x / W and unbiased weighted
    variance sigma^2 = sum w (x - mu)^2 / (W - 1), W = sum w (W counts tokens, so W - 1 is
    Bessel's correction over tokens). W = 0 gives mu = sigma = 0, never NaN."""
    total = weight.sum()
    mu = (weight * x).sum() / total.clamp(min=1)
    var = (weight * (x - mu) ** 2).sum() / (total - 1).clamp(min=1)
    return (x - mu) / (var.sqrt() + eps)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Whiten x over the masked-in entries: (x - mean) / (std + eps), mean and unbiased std
    over the entries where mask = 1; entries where mask = 0 come back as 0."""
    return _weighted_whiten(x, mask, eps) * mask


@ADVANTAGES.register("grpo", inputs=("rewards", "group_index", "eps"))
def grpo(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + eps), std with Bessel's correction.

    A group of one gets 0; a group whose rewards are all equal gets 0 (no gradient).
    """
    mean, std, n = _group_stats(rewards, group_index)
    return torch.where(n > 1, (rewards - mean) / (std + eps), torch.zeros_like(rewards))


@ADVANTAGES.register("dr_grpo", inputs=("rewards", "group_index"))
def dr_grpo(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: A_i = r_i - mean(r), no std scaling (pair with `seq-mean-token-sum-norm`).

    A group of one gets 0 (r_i - r_i).
    """
    mean, _, _ = _group_stats(rewards, group_index)
    return rewards - mean


@ADVANTAGES.register("rloo", inputs=("rewards", "group_index"))
def rloo(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r)).

    A group of one gets 0 (r_i - mean(r) = 0)."""
    mean, _, n = _group_stats(rewards, group_index)
    return n / (n - 1).clamp(min=1) * (rewards - mean)


@ADVANTAGES.register("reinforce_pp", inputs=("rewards", "group_index", "tokens", "eps"))
def reinforce_pp(
    rewards: torch.Tensor, group_index: torch.Tensor, tokens: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ (with group baseline): a_i = r_i - mean(r) within the group, then whitened
    over the batch's masked tokens, A_i = (a_i - mu) / (sigma + eps), where each item counts
    once per loss token (n_i = tokens[i], |o_i| for a trajectory):

        mu = sum_i n_i a_i / N_tok,  sigma^2 = sum_i n_i (a_i - mu)^2 / (N_tok - 1),
        N_tok = sum_i n_i.

    This is exactly `whiten` of the advantage broadcast to tokens, for trajectories and, under
    turn credit, for turns alike. `tokens` is required because the definition weights by it.
    """
    mean, _, _ = _group_stats(rewards, group_index)
    return _weighted_whiten(rewards - mean, tokens.to(rewards.dtype), eps)


@ADVANTAGES.register("gae", knobs=("critic.gamma", "critic.lam", "critic.whiten"),
                     inputs=("token_rewards", "values", "mask", "eps"))
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over masked-in tokens only: returns (advantages, returns), both [B, T], 0 off-mask.

    Walking each row backwards over the tokens with m_t = 1 (t' = the next such token after t):

        delta_t = r_t + gamma * V_{t'} - V_t     (V after the last generated token is 0)
        A_t     = delta_t + gamma * lam * A_{t'}
        returns = A + V                          (before whitening)

    Tokens with m_t = 0 are skipped, not terminals: a tool-output span between two generated
    turns is invisible to the recursion, and their rewards/values are ignored. With `whiten`
    (the default; the knob `critic.whiten`) the advantages are then whitened over the batch's
    masked tokens, as the module function `whiten` does (which the flag shadows here).
    """
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        on = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(on, adv, torch.zeros_like(adv))
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, adv, next_adv)
    returns = (advantages + values) * mask
    if whiten:
        advantages = _weighted_whiten(advantages, mask, eps) * mask
    return advantages, returns


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards for GAE: r_i on the last generated token of row i, 0 elsewhere.

    A row with no generated token gets no reward (all zeros)."""
    positions = torch.arange(mask.size(1), device=mask.device)
    last = (mask * positions).argmax(dim=1)
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    out[torch.arange(mask.size(0)), last] = rewards * (mask.sum(dim=1) > 0)
    return out


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss per token (aggregate it like a policy loss):

        V_clip = V_old + clip(V - V_old, -clip, clip)
        L = 0.5 * max((V - R)^2, (V_clip - R)^2)

    Returns (loss, {"clipped": 1 where the clipped term is strictly larger}), both 0 off-mask.
    """
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    sq = (values - returns) ** 2
    sq_clip = (v_clip - returns) ** 2
    loss = 0.5 * torch.maximum(sq, sq_clip) * mask
    return loss, {"clipped": (sq_clip > sq).float() * mask}


def overlong_penalty(lengths: torch.Tensor, l_max: int, l_cache: int) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward (l_cache > 0):

        0                                 if |o| <= l_max - l_cache
        (l_max - l_cache - |o|) / l_cache if l_max - l_cache < |o| <= l_max
        -1                                if |o| > l_max

    The middle branch reaches -1 at |o| = l_max, so this is clamp(middle, -1, 0).
    """
    return ((l_max - l_cache - lengths.float()) / l_cache).clamp(-1.0, 0.0)
