"""Turn-level credit for multi-turn trajectories with per-turn rewards.

Turn tensors are [N, K]: row i is trajectory i, column k its k-th generated turn; trajectories
with fewer than K turns are padded on the right with reward 0 and `turn_mask` 0. The outcome
reward is added by the caller to the last real turn's reward.

Pipeline: `turn_returns` -> `turn_advantages` (group baseline + the estimator's normalization)
-> `broadcast_turns` (every token of turn k gets A_{i,k}) -> loss mask times `apply_key_steps`.
`turn_credit` is that pipeline as a wrapper around any outcome estimator: the estimator sees
turns as its items, so no estimator needs a turn-level variant.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# An outcome estimator with its knobs bound: fn(rewards=[N], group_index=[N], tokens=[N]) -> [N]
# (`tokens`: each item's loss tokens; estimators that do not declare it never see it).
Estimate = Callable[..., torch.Tensor]


def turn_returns(turn_rewards: torch.Tensor, gamma_turn: float = 1.0) -> torch.Tensor:
    """R_{i,k} = sum_{k' >= k} gamma_turn^(k' - k) r_{i,k'}  (R_k = r_k + gamma_turn * R_{k+1})."""
    returns = torch.zeros_like(turn_rewards)
    running = torch.zeros_like(turn_rewards[:, 0])
    for k in reversed(range(turn_rewards.size(1))):
        running = turn_rewards[:, k] + gamma_turn * running
        returns[:, k] = running
    return returns


def turn_advantages(
    returns: torch.Tensor,
    turn_mask: torch.Tensor,
    turn_tokens: torch.Tensor,
    group_index: torch.Tensor,
    estimate: Estimate,
    baseline: str = "per_turn",
) -> torch.Tensor:
    """Per-turn advantages A_{i,k} from the returns R_{i,k} of the real turns (turn_mask = 1).

    The outcome estimator `estimate` is applied to the returns, each real turn an item with
    `turn_tokens[i, k]` loss tokens, the "group" being:
    - `per_turn`: the group's trajectories at the same turn index k (those that have a turn k),
    - `pooled`: all real turns of all the group's trajectories.
    E.g. grpo + per_turn: A_{i,k} = (R_{i,k} - mean_j R_{j,k}) / (std_j R_{j,k} + eps); and
    reinforce_pp whitens over the turns weighted by their tokens, which is whitening over the
    batch's tokens. Padded turns get 0.
    """
    valid = turn_mask > 0
    groups = group_index[:, None].expand_as(returns)
    if baseline == "per_turn":
        turns = torch.arange(returns.size(1), device=returns.device).expand_as(returns)
        groups = groups * returns.size(1) + turns
    elif baseline != "pooled":
        raise ValueError(f"turn baseline must be 'per_turn' or 'pooled', got {baseline!r}")
    out = torch.zeros_like(returns)
    out[valid] = estimate(rewards=returns[valid], group_index=groups[valid],
                          tokens=turn_tokens[valid])
    return out


def turn_credit(
    estimate: Estimate,
    turn_rewards: torch.Tensor,
    turn_spans: Sequence[Sequence[tuple[int, int]]],
    group_index: torch.Tensor,
    mask: torch.Tensor,
    gamma_turn: float = 1.0,
    baseline: str = "per_turn",
) -> torch.Tensor:
    """Turn-level credit around an outcome estimator: [B, T] token advantages, 0 off `mask`.

    `turn_rewards` [B, K] are each turn's full rewards (the caller adds the outcome to the last
    turn and any KL-in-reward term); R = `turn_returns`, A_{i,k} = `turn_advantages` with each
    turn's loss tokens as its weight, every token of turn k gets A_{i,k} (`broadcast_turns`).
    """
    turns = turn_rewards.size(1)
    counts = torch.tensor([len(s) for s in turn_spans])
    turn_mask = (torch.arange(turns)[None, :] < counts[:, None]).float()
    turn_tokens = turn_sums(mask, turn_spans, turns)
    returns = turn_returns(turn_rewards, gamma_turn)
    turn_adv = turn_advantages(returns, turn_mask, turn_tokens, group_index, estimate, baseline)
    return broadcast_turns(turn_adv, turn_spans, mask.size(1)) * mask


def turn_sums(x: torch.Tensor, spans: Sequence[Sequence[tuple[int, int]]], turns: int
              ) -> torch.Tensor:
    """[B, turns]: the sum of per-token x [B, T] over each turn's tokens [start, end)."""
    out = x.new_zeros((x.size(0), turns))
    for i, row in enumerate(spans):
        for k, (start, end) in enumerate(row):
            out[i, k] = x[i, start:end].sum()
    return out


def broadcast_turns(
    turn_adv: torch.Tensor, turn_spans: Sequence[Sequence[tuple[int, int]]], width: int
) -> torch.Tensor:
    """[N, width] token advantages: A_{i,k} on every token t in [start, end) of turn k of
    trajectory i (`Trajectory.turn_spans`), 0 elsewhere (prompt, tool output, padding)."""
    out = torch.zeros(turn_adv.size(0), width, dtype=turn_adv.dtype)
    for i, spans in enumerate(turn_spans):
        for k, (start, end) in enumerate(spans):
            out[i, start:end] = turn_adv[i, k]
    return out


def apply_key_steps(mask: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """Key-step masking: m * key_mask, e.g. key_mask = 1 only on tool-call arguments and final
    answers. Dropping tokens from the loss keeps the estimator unbiased and cuts noise."""
    return mask * key_mask
