"""Turn-level credit for multi-turn trajectories with per-turn rewards.

Turn tensors are [N, K]: row i is trajectory i, column k its k-th generated turn; trajectories
with fewer than K turns are padded on the right with reward 0 and `turn_mask` 0. The outcome
reward is added by the caller to the last real turn's reward.

Pipeline: `turn_returns` -> `turn_advantages` (group baseline + the estimator's normalization)
-> `broadcast_turns` (every token of turn k gets A_{i,k}) -> loss mask times `apply_key_steps`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiller.train.algorithms.registry import ADVANTAGES


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
    group_index: torch.Tensor,
    estimator: str = "grpo",
    baseline: str = "per_turn",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-turn advantages A_{i,k} from the returns R_{i,k} of the real turns (turn_mask = 1).

    The baseline statistics are those of an outcome estimator (`grpo`, `dr_grpo`, `rloo`) applied
    to the returns, with the "group" being:
    - `per_turn`: the group's trajectories at the same turn index k (those that have a turn k),
    - `pooled`: all real turns of all the group's trajectories.
    E.g. grpo + per_turn: A_{i,k} = (R_{i,k} - mean_j R_{j,k}) / (std_j R_{j,k} + eps).
    Padded turns get 0.
    """
    valid = turn_mask > 0
    groups = group_index[:, None].expand_as(returns)
    if baseline == "per_turn":
        turns = torch.arange(returns.size(1), device=returns.device).expand_as(returns)
        groups = groups * returns.size(1) + turns
    elif baseline != "pooled":
        raise ValueError(f"turn baseline must be 'per_turn' or 'pooled', got {baseline!r}")
    out = torch.zeros_like(returns)
    out[valid] = ADVANTAGES[estimator](returns[valid], groups[valid], eps)
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
