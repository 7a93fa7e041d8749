"""Off-policy correction: rollout-vs-trainer mismatch, truncated importance sampling, staleness.

`logp_rollout` is what the rollout engine reported when it sampled a token, `logp_old` what the
trainer recomputes with the sampling version's weights (or the proximal policy with decoupled
PPO). Tensors are [batch, time]; `mask` is 1 on generated tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def tis_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, C: float = 2.0) -> torch.Tensor:
    """Truncated importance weight per token, w = min(exp(logp_old - logp_rollout), C), detached.

    Multiply each token's policy loss by w. Decoupled PPO's behaviour weight is the same
    function: tis_weights(logp_prox, logp_behaviour, C).
    """
    return torch.exp(logp_old - logp_rollout).clamp(max=C).detach()


def mismatch_stats(
    logp_rollout: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Mismatch metrics over masked tokens (all 0.0 when there are none):

    logp_mismatch_mean = mean |logp_rollout - logp_old|, logp_mismatch_max = max of the same,
    importance_weight_mean = mean exp(logp_old - logp_rollout) (untruncated).
    """
    n = float(mask.sum())
    gap = (logp_rollout - logp_old).abs() * mask
    weight = torch.exp(logp_old - logp_rollout) * mask
    return {
        "logp_mismatch_mean": float(gap.sum()) / max(n, 1.0),
        "logp_mismatch_max": float(gap.max()) if n else 0.0,
        "importance_weight_mean": float(weight.sum()) / max(n, 1.0),
    }


def staleness(trainer_version: int, sample_versions: Iterable[int]) -> int:
    """trainer_version - (oldest policy version that sampled any turn of the trajectory)."""
    return trainer_version - min(sample_versions)
