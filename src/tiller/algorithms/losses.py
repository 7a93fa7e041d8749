"""Per-token policy losses (before aggregation).

Signature: `fn(logp, logp_old, advantages, mask, *, <declared knobs>) -> (loss, stats)`.
Tensors are [batch, time] (`advantages` may also be a [batch, 1] column); `mask` is 1 on
generated tokens. `loss` is 0 where mask is 0. `stats` holds float 0/1 indicator tensors, also 0
off-mask, so `stats["clipped"].sum() / mask.sum()` is the clip fraction:

- `clipped_low`: A < 0 and rho < 1 - eps_low (the clipped branch was taken),
- `clipped_high`: A > 0 and rho > 1 + eps_high (the clipped branch was taken),
- `dual_clipped`: A < 0 and the dual-clip cap -c*A was taken (all 0 when dual clip is off),
- `clipped`: any of the three.

`cispo` clips the weight whatever the sign of A, so its `clipped_low` / `clipped_high` mark the
tokens whose weight was truncated at 1 - eps_low / 1 + eps_high; `sapo` has no hard clip (all 0).

The entropy bonus is a separate helper (`entropy_bonus`) applied to any loss's output, so every
policy loss stays a function of log-probabilities only.
"""

from __future__ import annotations

import torch

from tiller.algorithms.registry import POLICY_LOSSES


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L = -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A); with dual clip, for A < 0,
    L = min(L, -c*A). Shared by `ppo_clip` (token ratio) and `gspo` (sequence ratio)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    took_clip = clipped < unclipped
    dual = torch.zeros_like(took_clip)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        cap = -clip_ratio_c * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    low = took_clip & (ratio < 1 - eps_low)
    high = took_clip & (ratio > 1 + eps_high)
    return loss * mask, _clip_stats(low, high, dual, mask)


def _clip_stats(
    low: torch.Tensor, high: torch.Tensor, dual: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The four 0/1 indicator tensors of the module docstring, 0 off the mask."""
    stats = {"clipped": low | high | dual, "clipped_low": low, "clipped_high": high,
             "dual_clipped": dual}
    return {k: v.float() * mask for k, v in stats.items()}


@POLICY_LOSSES.register("ppo_clip", knobs=("eps_low", "eps_high", "clip_ratio_c"))
def ppo_clip(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip: rho = exp(logp - logp_old),
    L = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A).

    Symmetric PPO is eps_low = eps_high = 0.2; DAPO's clip-higher raises eps_high to 0.28.
    Dual clip (`clip_ratio_c` = c > 1, typically 3): for tokens with A < 0, L = min(L, -c * A).
    """
    ratio = torch.exp(logp - logp_old)
    return _clipped_surrogate(ratio, advantages, mask, eps_low, eps_high, clip_ratio_c)


@POLICY_LOSSES.register("gspo", knobs=("eps_low", "eps_high"))
def gspo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (token form): sequence ratio
        s_i = exp( (1/|o_i|) * sum_t m_{i,t} (logp_{i,t} - logp_old_{i,t}) ),
        s_{i,t} = sg[s_i] * exp(logp_{i,t} - sg[logp_{i,t}])   (value s_i, per-token gradient),
        L = -min(s_{i,t} * A_i, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) * A_i).

    The paper's clip ranges are 3e-4 / 4e-4 (the defaults). |o_i| is clamped to 1, so a row with
    no generated token has s_i = 1 and loss 0, never NaN. No dual clip, as published.
    """
    length = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = ((logp - logp_old) * mask).sum(dim=-1, keepdim=True) / length
    ratio = torch.exp(seq_log_ratio.detach() + logp - logp.detach())
    return _clipped_surrogate(ratio, advantages, mask, eps_low, eps_high, None)


@POLICY_LOSSES.register("cispo", knobs=("eps_low", "eps_high"))
def cispo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1): clip the importance weight, not the update,
        w = sg[clip(rho, 1 - eps_low, 1 + eps_high)],   L = -w * A * logp,
    so dL/dlogp = -w * A on EVERY token (PPO zeroes the gradient of clipped tokens; here a
    token far off-policy keeps a bounded one). The value of L is a surrogate, only its gradient
    means something. The paper leaves the lower bound open and tunes eps_high: eps_low = 1 (the
    default) puts the lower bound at 0, which a ratio never crosses.
    """
    ratio = torch.exp(logp - logp_old).detach()
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -weight * advantages * logp
    no_dual = torch.zeros_like(ratio, dtype=torch.bool)
    return loss * mask, _clip_stats(ratio < 1 - eps_low, ratio > 1 + eps_high, no_dual, mask)


@POLICY_LOSSES.register("sapo", knobs=("tau_pos", "tau_neg"))
def sapo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (soft adaptive policy optimization): a smooth gate instead of a hard clip,
        s = sigmoid(tau * (rho - 1)),   L = -(4 / tau) * s * A,
    with tau = tau_pos where A > 0 and tau_neg where A < 0. Its gradient,
        dL/dlogp = -4 s (1 - s) * rho * A,
    is the policy gradient -A at rho = 1 (4 s (1 - s) = 1 there) and decays smoothly as rho
    leaves 1, faster for larger tau (so tau_neg > tau_pos damps negative updates more). Nothing
    is clipped: the clip stats are all 0.
    """
    ratio = torch.exp(logp - logp_old)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    loss = -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * advantages
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return loss * mask, _clip_stats(none, none, none, mask)


def entropy_bonus(loss: torch.Tensor, entropy: torch.Tensor, beta_ent: float) -> torch.Tensor:
    """L - beta_ent * H per token, H = -sum_v p_v log p_v over the vocabulary (the trainer's
    per-token entropy). Apply to a policy loss's output before aggregation (which masks)."""
    return loss - beta_ent * entropy
