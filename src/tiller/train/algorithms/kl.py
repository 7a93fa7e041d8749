"""KL(pi_theta || pi_ref) per-token estimators and the KL-in-reward placement.

With d = logp_ref - logp (per token, [batch, time]):
k1 = -d, k2 = 0.5 * d^2, k3 = exp(d) - d - 1. Two placements: `kl_loss` adds beta * k to the
per-token loss (the trainer does it with a `KL_ESTIMATORS` entry); `kl_in_reward` subtracts
beta * k1 from the per-token reward (PPO style). beta = 0 means no reference model at all.
"""

from __future__ import annotations

import torch

from tiller.train.algorithms.registry import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1")
def k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k1 = logp - logp_ref = -d: unbiased, high variance, can be negative."""
    return logp - logp_ref


@KL_ESTIMATORS.register("k2")
def k2(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * d^2 with d = logp_ref - logp: non-negative, biased, low variance."""
    return 0.5 * (logp_ref - logp) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 with d = logp_ref - logp: non-negative, unbiased for
    KL(pi || pi_ref), low variance (GRPO's choice)."""
    d = logp_ref - logp
    return torch.exp(d) - d - 1


def kl_in_reward(
    token_rewards: torch.Tensor,
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    beta: float,
    mask: torch.Tensor,
) -> torch.Tensor:
    """r'_t = r_t - beta * k1_t * m_t (PPO-style KL penalty in the reward; no gradient flows).

    `logp` is the sampling policy's log-probability (logp_old), so the result is detached."""
    return (token_rewards - beta * k1(logp, logp_ref) * mask).detach()


def kl_beta_at(step: int, beta: float, off_after: int | None = None) -> float:
    """The KL coefficient at optimizer step `step`: beta, or 0 from step `off_after` on."""
    return 0.0 if off_after is not None and step >= off_after else beta
