"""The RL algorithm (`rl.algorithm`): estimators, losses, aggregation, off-policy
correction and their knobs, resolved from a preset and the registries (docs/algorithms.md)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tiller.algorithms import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, OFF_POLICY, POLICY_LOSSES
from tiller.algorithms.presets import PRESETS
from tiller.algorithms.resolve import resolve
from tiller.config.base import Section, merge, registered
from tiller.errors import ConfigError


class KLConfig(Section):
    """KL(pi || pi_ref). beta = 0 means no reference model at all (no reference forward)."""

    beta: float = Field(0.0, ge=0.0, description="the KL coefficient: placement loss adds "
                        "beta * k per token to the loss, placement reward subtracts beta * k1 "
                        "from each token's reward; 0 = no reference model")
    estimator: str | None = Field(
        None, description="the per-token estimator k of placement loss: k1 | k2 | k3 | abs | "
        "k1+ | k3+ (default k3)"
    )
    placement: Literal["loss", "reward"] | None = Field(
        None, description="loss: + beta * k per token; reward: - beta * k1 from the reward"
    )
    off_after: int | None = Field(None, ge=0, description="RL step from which beta is 0")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, name: str | None) -> str | None:
        return name if name is None else registered(name, KL_ESTIMATORS)


class DynamicSamplingConfig(Section):
    """DAPO: drop zero-variance groups, refill with new groups up to `max_rounds` rounds."""

    enabled: bool = Field(False, description="drop groups whose rewards are all equal (no "
                          "advantage to learn from) and sample new groups in their place")
    max_rounds: int | None = Field(
        None, ge=1, description="generation rounds per step, the first one included (default 3)"
    )


class OverlongConfig(Section):
    """Truncated episodes: `mask` them out of the loss, or `soft`-punish their length."""

    mode: Literal["none", "mask", "soft"] = Field(
        "none", description="none: truncated episodes train like any other; mask: they are "
        "left out of the loss; soft: DAPO's length penalty on every episode's reward, 0 up to "
        "l_max - l_cache generated tokens, falling linearly to -1 at l_max")
    l_cache: int | None = Field(None, ge=1, description="soft buffer (default 20% of l_max)")


class CreditConfig(Section):
    """Turn-level credit (used when the verifier gives `Reward.turn_rewards`) and key steps."""

    gamma_turn: float | None = Field(
        None, ge=0.0, le=1.0, description="discount per turn of turn rewards: a turn's return "
        "is R_k = r_k + gamma_turn * R_(k+1) (default 1.0)")
    turn_baseline: Literal["per_turn", "pooled"] | None = Field(
        None, description="group baseline per turn index, or pooled over turns (default per_turn)"
    )
    key_steps: str | None = Field(
        None, description="dotted path of fn(trajectory, tokenizer) -> 0/1 per token, "
        "multiplied into the loss mask"
    )


class CriticConfig(Section):
    """The value model of the `gae` estimator (PPO)."""

    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount per token of GAE's "
                         "returns")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE's lambda: 1 = Monte Carlo "
                       "returns (unbiased, noisy), 0 = one-step TD (the critic's bias)")
    value_lr: float = Field(1e-3, gt=0, description="AdamW's learning rate of the critic (its "
                            "own optimizer)")
    value_clip: float = Field(0.2, gt=0, description="PPO's clipped value loss: V may move at "
                              "most this far from V_old per batch before the clipped term "
                              "takes over")
    whiten: bool = Field(True, description="whiten GAE advantages over the batch's tokens")


# the fields of rl.algorithm named after a registry entry, and the registry each is checked in
REGISTRIES = {"advantage": ADVANTAGES, "policy_loss": POLICY_LOSSES,
              "aggregation": AGGREGATIONS, "off_policy": OFF_POLICY}


class AlgorithmConfig(Section):
    """Every estimator and loss of ALGORITHMS.md, chosen by name (see docs/algorithms.md).

    Resolution: the `preset` (if any) gives defaults, the user's keys override them; a knob the
    resulting algorithm ignores is an error if the user set it (a preset's own value is just
    dropped); unset knobs the algorithm uses get their defaults (e.g. the clip range is the
    chosen loss's own default, so `gspo` gets 3e-4 / 4e-4, never PPO's 0.2). The resolved
    config is what a run saves, and it loads back to itself.
    """

    preset: str | None = Field(None, description="grpo | dapo | dr_grpo | gspo | ppo | rloo | "
                               "reinforce_pp: a set of defaults for the knobs below")
    advantage: str = Field("grpo", description="the advantage estimator: grpo | dr_grpo | "
                           "rloo | reinforce_pp | gae (gae adds a critic)")
    policy_loss: str = Field("ppo_clip", description="the policy loss: ppo_clip | gspo | "
                             "cispo | sapo")
    eps_low: float | None = Field(None, ge=0.0, description="clip range below 1 (ppo_clip, gspo; "
                                  "cispo's IS-weight bound); default: the loss's own")
    eps_high: float | None = Field(None, ge=0.0, description="clip range above 1 (ppo_clip, "
                                   "gspo; cispo's IS-weight bound); default: the loss's own")
    clip_ratio_c: float | None = Field(None, gt=1.0, description="dual clip (ppo_clip only)")
    tau_pos: float | None = Field(None, gt=0.0, description="sapo's gate temperature where "
                                  "A > 0 (default 1.0)")
    tau_neg: float | None = Field(None, gt=0.0, description="sapo's gate temperature where "
                                  "A < 0 (default 1.05)")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus: L -= coef * H")
    advantage_eps: float | None = Field(
        None, gt=0.0, description="the epsilon in the advantage's denominator (std + eps) of "
        "the estimators that whiten: grpo, reinforce_pp, gae (default 1e-6)")
    aggregation: str = Field("token-mean", description="how per-token losses become the "
                             "batch's loss: token-mean | seq-mean-token-mean | "
                             "seq-mean-token-sum | seq-mean-token-sum-norm | token-sum")
    l_max: int | None = Field(
        None, ge=1, description="max generated tokens per episode (default: the env's budget, "
        "min(env.max_turns * sampling.max_new_tokens, env.max_episode_tokens))"
    )
    off_policy: str = Field(
        "none", description="off-policy correction, a weight on each token's policy loss: "
        "none | tis | mis | mis_mask | seq_is | decoupled | decoupled_tis. Default: none in "
        "rl.mode sync (and async with max_staleness 0), mis where samples can be stale "
        "(one_step_off, async; docs/async.md says why), where none is an error unless "
        "allow_uncorrected_off_policy")
    allow_uncorrected_off_policy: bool | None = Field(
        None, description="true: accept off_policy: none on stale samples (rl.mode "
        "one_step_off or async with max_staleness > 0), which treats them as on-policy "
        "(docs/async.md records such a run collapsing); only with off_policy: none there")
    is_cap: float | None = Field(None, gt=0.0, description="importance weight cap C: tis, "
                                 "seq_is and decoupled_tis truncate at it (default 2.0), "
                                 "decoupled removes tokens above it (default 5.0)")
    mis_low: float | None = Field(None, ge=0.0, lt=1.0, description="mis, mis_mask: tokens "
                                  "whose exp(logp_old - logp_rollout) is below this are "
                                  "removed (default 0.5; 0: no lower bound)")
    mis_high: float | None = Field(None, gt=1.0, description="mis, mis_mask: tokens whose "
                                   "exp(logp_old - logp_rollout) is above this are removed "
                                   "(default 5.0)")
    kl: KLConfig = Field(default_factory=KLConfig, description="the KL penalty to the "
                         "reference model (the policy at the start of RL)")
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="DAPO's dynamic sampling")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig,
                                     description="long episodes: truncated ones "
                                     "masked, or a length penalty")
    credit: CreditConfig = Field(default_factory=CreditConfig,
                                 description="turn-level credit and key-step masks")
    critic: CriticConfig | None = Field(None, description="the value model of advantage gae "
                                        "(filled in for it; refused with other estimators)")

    @field_validator(*REGISTRIES)
    @classmethod
    def _registered(cls, name: str, info: ValidationInfo) -> str:
        return registered(name, REGISTRIES[info.field_name])

    @model_validator(mode="wrap")
    @classmethod
    def _resolve(cls, data: Any, handler: Callable[[Any], AlgorithmConfig]) -> AlgorithmConfig:
        if not isinstance(data, dict):  # an instance (already resolved) or an assignment
            return handler(data)
        user = copy.deepcopy(data)
        if "tis_c" in user:  # removed in issue 9: say what replaced it, not just "extra field"
            raise ConfigError(f"config field rl.algorithm.tis_c: got {user['tis_c']!r}; it was "
                              "replaced by off_policy: tis with is_cap: C (the same weight "
                              "min(exp(logp_old - logp_rollout), C)); for tis_c: null, remove "
                              "it (off_policy: none is the default)")
        preset = user.get("preset")
        if preset is not None and preset not in PRESETS:
            raise ConfigError(f"config field rl.algorithm.preset: got {preset!r}; "
                              f"expected one of: {', '.join(PRESETS)}")
        base = copy.deepcopy(PRESETS.get(preset, {}))
        if "policy_loss" in user:  # a preset's clip range belongs to the preset's loss
            base.pop("eps_low", None), base.pop("eps_high", None)
        return resolve(user, merge(base, user), handler)
