"""Off-policy correction: the per-token weight on the policy loss (registry `OFF_POLICY`, chosen
by `rl.algorithm.off_policy`), the rollout-vs-trainer mismatch metrics, and staleness.

`logp_rollout` is what the rollout engine reported when it sampled a token (the behaviour
policy), `logp_old` what the trainer computes at train start (the proximal policy: the weights
before this update, which in async mode are newer than the ones that sampled the batch).
Tensors are [batch, time]; `mask` is 1 on generated tokens.

Signature: `fn(<declared inputs>, *, <declared knobs>) -> (weight, stats)`. `weight` [B, T] is
detached; the trainer multiplies each token's policy loss by it (0 removes a token, leaving
the aggregation's normalizers as they are: a weight, not a mask). `stats` holds float 0/1
indicator tensors, 0 off-mask: `masked` (the weight was set to 0) and `truncated` (the weight was
capped at C). An entry that declares the input `logp_prox` gets the proximal policy from a
no-grad prepass that the trainer always runs for it (`decoupled`, `decoupled_tis`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tiller.algorithms.registry import OFF_POLICY

Stats = dict[str, torch.Tensor]
_INPUTS = ("logp_old", "logp_rollout", "mask")


def _stats(masked: torch.Tensor, truncated: torch.Tensor, mask: torch.Tensor) -> Stats:
    return {"masked": masked.float() * mask, "truncated": truncated.float() * mask}


@OFF_POLICY.register("none", inputs=_INPUTS)
def no_correction(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor
                  ) -> tuple[torch.Tensor, Stats]:
    """w = 1: the loss as the policy loss computes it."""
    none = torch.zeros_like(mask, dtype=torch.bool)
    return torch.ones_like(mask), _stats(none, none, mask)


@OFF_POLICY.register("tis", knobs=("is_cap",), inputs=_INPUTS)
def tis(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
        is_cap: float = 2.0) -> tuple[torch.Tensor, Stats]:
    """Truncated importance sampling, per token: w = min(exp(logp_old - logp_rollout), C),
    C = `is_cap`. Corrects the rollout engine's numerical mismatch and mild staleness by
    down-weighting tokens the trainer finds less likely than the engine did, capping the rest."""
    ratio = torch.exp(logp_old - logp_rollout).detach()
    none = torch.zeros_like(mask, dtype=torch.bool)
    return ratio.clamp(max=is_cap), _stats(none, ratio > is_cap, mask)


def _in_band(ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return (ratio >= low) & (ratio <= high)


@OFF_POLICY.register("mis", knobs=("mis_low", "mis_high"), inputs=_INPUTS)
def mis(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
        mis_low: float = 0.5, mis_high: float = 5.0) -> tuple[torch.Tensor, Stats]:
    """Masked importance sampling, as published (IcePop; the masked IS of Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"):
        rho = exp(logp_old - logp_rollout),   w = M(rho) = rho if mis_low <= rho <= mis_high,
                                              else 0.
    Inside the band the token keeps its importance weight (it is not capped); outside it the
    token leaves the loss (counted in `masked`) instead of being down-weighted. The defaults
    0.5 / 5.0 are IcePop's [alpha, beta]; mis_low = 0 is the one-sided form w = rho * 1{rho <= C}
    (C = mis_high)."""
    ratio = torch.exp(logp_old - logp_rollout).detach()
    keep = _in_band(ratio, mis_low, mis_high)
    none = torch.zeros_like(keep)
    return torch.where(keep, ratio, torch.zeros_like(ratio)), _stats(~keep, none, mask)


@OFF_POLICY.register("mis_mask", knobs=("mis_low", "mis_high"), inputs=_INPUTS)
def mis_mask(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
             mis_low: float = 0.5, mis_high: float = 5.0) -> tuple[torch.Tensor, Stats]:
    """Token rejection without importance weights (tiller's `mis` before issue 19; verl's
    token-level rejection sampling without IS weights): rho = exp(logp_old - logp_rollout),
    w = 1 where mis_low <= rho <= mis_high, else 0 (removed, counted in `masked`). Tokens
    inside the band are not reweighted, so the estimate stays biased by the mismatch the band
    lets through; `mis` reweights them."""
    ratio = torch.exp(logp_old - logp_rollout).detach()
    keep = _in_band(ratio, mis_low, mis_high)
    none = torch.zeros_like(keep)
    return keep.float(), _stats(~keep, none, mask)


@OFF_POLICY.register("seq_is", knobs=("is_cap",), inputs=_INPUTS)
def seq_is(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
           is_cap: float = 2.0) -> tuple[torch.Tensor, Stats]:
    """Sequence-level IS: one weight per trajectory,
        w_i = min(exp(sum_t m_{i,t} (logp_old_{i,t} - logp_rollout_{i,t})), C),
    broadcast to the row's tokens (exp overflowing to inf is capped to C like any other value).
    The whole trajectory's likelihood ratio: unbiased for sequence-level rewards, with a
    variance that grows with length, hence the cap."""
    log_ratio = ((logp_old - logp_rollout) * mask).sum(-1, keepdim=True).detach()
    ratio = torch.exp(log_ratio).expand_as(mask)
    none = torch.zeros_like(mask, dtype=torch.bool)
    return ratio.clamp(max=is_cap), _stats(none, ratio > is_cap, mask)


_PROXIMAL = ("logp_prox", "logp_behaviour", "mask")


@OFF_POLICY.register("decoupled", knobs=("is_cap",), inputs=_PROXIMAL)
def decoupled(logp_prox: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor,
              is_cap: float = 5.0) -> tuple[torch.Tensor, Stats]:
    """Decoupled PPO as AReaL publishes it (Fu et al. 2025): the policy loss is anchored on the
    proximal policy (its ratio is exp(logp - logp_prox), clipped by the loss), and multiplied
    by the behaviour importance weight, with tokens above the cap filtered out:
        rho = exp(logp_prox - logp_behaviour),   behaviour = the rollout logprobs,
        w = rho if rho <= C else 0,   C = `is_cap` (default 5.0, AReaL's example configs).
    A token the proximal policy finds more than C times likelier than the policy that sampled
    it leaves the loss (counted in `masked`); below the cap it keeps its full weight.

    Declaring the input `logp_prox` makes the trainer recompute it with a no-grad prepass at
    train start in every schedule, including one optimizer step without KL in the reward."""
    ratio = torch.exp(logp_prox - logp_behaviour).detach()
    over = ratio > is_cap
    none = torch.zeros_like(over)
    return torch.where(over, torch.zeros_like(ratio), ratio), _stats(over, none, mask)


@OFF_POLICY.register("decoupled_tis", knobs=("is_cap",), inputs=_PROXIMAL)
def decoupled_tis(logp_prox: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor,
                  is_cap: float = 2.0) -> tuple[torch.Tensor, Stats]:
    """Decoupled PPO with a truncated behaviour weight (tiller's `decoupled` before issue 19):
    the proximal prepass of `decoupled`, and the weight of `tis`,
        w = min(exp(logp_prox - logp_behaviour), C),   C = `is_cap` (default 2.0):
    a token above the cap keeps weight C (counted in `truncated`) where `decoupled` removes
    it."""
    return tis(logp_prox, logp_behaviour, mask, is_cap=is_cap)


def correction_stats(weight: torch.Tensor, stats: Stats, mask: torch.Tensor) -> dict[str, float]:
    """The applied weight over masked tokens: is_weight_mean, is_weight_max; is_masked_frac and
    is_truncated_frac, the share of masked tokens the correction removed / capped (all 0.0,
    and the weight 1.0, when there are no masked tokens)."""
    n = float(mask.sum())
    on = weight[mask > 0]
    return {
        "is_weight_mean": float(on.mean()) if n else 1.0,
        "is_weight_max": float(on.max()) if n else 1.0,
        "is_masked_frac": float(stats["masked"].sum()) / max(n, 1.0),
        "is_truncated_frac": float(stats["truncated"].sum()) / max(n, 1.0),
    }


def mismatch_stats(
    logp_rollout: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Mismatch metrics over masked tokens (all 0.0 when there are none):

    logp_mismatch_mean = mean |logp_rollout - logp_old|, logp_mismatch_max = max of the same,
    importance_weight_mean / importance_weight_max = mean / max exp(logp_old - logp_rollout)
    (untruncated: what the correction saw, before it capped or masked anything).
    """
    n = float(mask.sum())
    gap = (logp_rollout - logp_old).abs() * mask
    weight = torch.exp(logp_old - logp_rollout) * mask
    return {
        "logp_mismatch_mean": float(gap.sum()) / max(n, 1.0),
        "logp_mismatch_max": float(gap.max()) if n else 0.0,
        "importance_weight_mean": float(weight.sum()) / max(n, 1.0),
        "importance_weight_max": float(weight[mask > 0].max()) if n else 0.0,
    }


def staleness_stats(logp_rollout: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor,
                    row_staleness: torch.Tensor) -> dict[str, float]:
    """Mismatch by staleness. `row_staleness` [B] is the trainer version minus each row's
    sample version; rows whose version is unknown carry -1 and are left out. With
    d = |logp_old - logp_rollout| on masked tokens:

    staleness_weighted_mismatch = sum s_i d_{i,t} / sum s_i over the same tokens (0.0 when no
    token is stale), mismatch_fresh / mismatch_stale = mean d on rows with s = 0 / s > 0
    (each absent when there is no such token)."""
    gap = (logp_rollout - logp_old).abs() * mask
    s = row_staleness.to(gap.dtype)[:, None].expand_as(gap)
    known = (s >= 0) & (mask > 0)
    weight = torch.where(known, s, torch.zeros_like(s))
    total = float(weight.sum())
    out = {"staleness_weighted_mismatch": float((weight * gap).sum()) / total if total else 0.0}
    for key, rows in (("mismatch_fresh", known & (s == 0)), ("mismatch_stale", known & (s > 0))):
        if rows.any():
            out[key] = float(gap[rows].mean())
    return out


def staleness(trainer_version: int, sample_versions: Iterable[int]) -> int:
    """trainer_version - (oldest policy version that sampled any turn of the trajectory)."""
    return trainer_version - min(sample_versions)
