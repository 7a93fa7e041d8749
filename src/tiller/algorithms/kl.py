"""KL(pi_theta || pi_ref) per-token estimators and the KL-in-reward placement.

With d = logp_ref - logp (per token, [batch, time]):
k1 = -d, k2 = 0.5 * d^2, k3 = exp(d) - d - 1, abs = |d|; the straight-through `k1+` and `k3+`
have the value of k1 / k3 and the gradient of k2. Two placements: `kl_loss` adds beta * k to the
per-token loss (the trainer does it with a `KL_ESTIMATORS` entry); `kl_in_reward` subtracts
beta * k1 from the per-token reward (PPO style). beta = 0 means no reference model at all.
"""

from __future__ import annotations

import torch

from tiller.algorithms.registry import KL_ESTIMATORS


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


@KL_ESTIMATORS.register("abs")
def kl_abs(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """abs = |d| = |logp - logp_ref|: non-negative, gradient sign(logp - logp_ref)."""
    return (logp - logp_ref).abs()


def _straight_through(value: torch.Tensor, logp: torch.Tensor, logp_ref: torch.Tensor
                      ) -> torch.Tensor:
    """k = k2 + sg[value - k2]: the value of `value`, the gradient of k2 (d k2 / d logp = -d)."""
    grad_part = k2(logp, logp_ref)
    return grad_part + (value - grad_part).detach()


@KL_ESTIMATORS.register("k1+")
def k1_plus(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k1+ = k2 + sg[k1 - k2]: k1's (unbiased) value, k2's gradient logp - logp_ref. Why: k1's
    own gradient is the constant 1, whose expectation under pi is 0, so as a loss k1 does not
    pull toward the reference; on-policy, k2's gradient is that of KL(pi || pi_ref)."""
    return _straight_through(k1(logp, logp_ref), logp, logp_ref)


@KL_ESTIMATORS.register("k3+")
def k3_plus(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3+ = k2 + sg[k3 - k2]: k3's value, k2's gradient logp - logp_ref (see `k1_plus`)."""
    return _straight_through(k3(logp, logp_ref), logp, logp_ref)


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
