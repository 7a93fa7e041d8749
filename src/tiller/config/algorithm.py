"""The RL algorithm (`rl.algorithm`): estimators, losses, aggregation, off-policy
correction and their knobs, resolved from a preset and the registries (docs/algorithms.md)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tiller.config.base import Section, merge, registered
from tiller.errors import ConfigError


class KLConfig(Section):
    """KL(pi || pi_ref). beta = 0 means no reference model at all (no reference forward)."""

    beta: float = Field(0.0, ge=0.0)
    estimator: str | None = Field(
        None, description="k1 | k2 | k3 | abs | k1+ | k3+ (default k3); placement loss"
    )
    placement: Literal["loss", "reward"] | None = Field(
        None, description="loss: + beta * k per token; reward: - beta * k1 from the reward"
    )
    off_after: int | None = Field(None, ge=0, description="RL step from which beta is 0")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, name: str | None) -> str | None:
        from tiller.train.algorithms import KL_ESTIMATORS

        return name if name is None else registered(name, KL_ESTIMATORS)


class DynamicSamplingConfig(Section):
    """DAPO: drop zero-variance groups, refill with new groups up to `max_rounds` rounds."""

    enabled: bool = False
    max_rounds: int | None = Field(
        None, ge=1, description="generation rounds per step, the first one included (default 3)"
    )


class OverlongConfig(Section):
    """Truncated episodes: `mask` them out of the loss, or `soft`-punish their length."""

    mode: Literal["none", "mask", "soft"] = "none"
    l_cache: int | None = Field(None, ge=1, description="soft buffer (default 20% of l_max)")


class CreditConfig(Section):
    """Turn-level credit (used when the verifier gives `Reward.turn_rewards`) and key steps."""

    gamma_turn: float | None = Field(None, ge=0.0, le=1.0, description="default 1.0")
    turn_baseline: Literal["per_turn", "pooled"] | None = Field(
        None, description="group baseline per turn index, or pooled over turns (default per_turn)"
    )
    key_steps: str | None = Field(
        None, description="dotted path of fn(trajectory, tokenizer) -> 0/1 per token, "
        "multiplied into the loss mask"
    )


class CriticConfig(Section):
    """The value model of the `gae` estimator (PPO)."""

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    value_lr: float = Field(1e-3, gt=0)
    value_clip: float = Field(0.2, gt=0)
    whiten: bool = Field(True, description="whiten GAE advantages over the batch's tokens")


def _estimator_takes(a: AlgorithmConfig, name: str) -> bool:
    """Whether the chosen advantage estimator declares input `name`."""
    from tiller.train.algorithms import ADVANTAGES

    return name in ADVANTAGES.inputs[a.advantage]


def _outcome_estimator(a: AlgorithmConfig) -> bool:
    """Turn-level credit wraps estimators of outcome rewards (those that declare `rewards`)."""
    return _estimator_takes(a, "rewards")


# An ignorable knob: (dotted name, is it used by this algorithm?, what uses it). A knob the final
# algorithm ignores must stay unset: setting it is an error naming it, never a silent no-op.
# The knobs of losses, estimators and aggregations come from their registry declarations
# (`_declared_knobs`); these are the others.
Ignorable = tuple[str, Callable[["AlgorithmConfig"], bool], str]


_IGNORABLE: list[Ignorable] = [
    ("kl.placement", lambda a: a.kl.beta > 0, "used only when kl.beta > 0"),
    ("kl.off_after", lambda a: a.kl.beta > 0, "used only when kl.beta > 0"),
    ("kl.estimator", lambda a: a.kl.beta > 0 and a.kl.placement != "reward",
     "used only when kl.beta > 0 and kl.placement is 'loss' (the reward penalty is k1)"),
    ("dynamic_sampling.max_rounds", lambda a: a.dynamic_sampling.enabled,
     "used only when dynamic_sampling.enabled is true"),
    ("overlong.l_cache", lambda a: a.overlong.mode == "soft",
     "used only when overlong.mode is 'soft'"),
    ("allow_uncorrected_off_policy", lambda a: a.off_policy == "none",
     "used only with off_policy: none (a correction is on)"),
    ("advantage_eps", lambda a: _estimator_takes(a, "eps"),
     "used only by estimators that divide by a std (grpo, reinforce_pp, gae)"),
    ("credit.gamma_turn", _outcome_estimator, "used only by outcome-reward estimators (a "
     "per-token estimator such as gae takes turn rewards per token, discounted by critic.gamma)"),
    ("credit.turn_baseline", _outcome_estimator,
     "used only by outcome-reward estimators (gae's baseline is its critic)"),
]


# Declared knobs that something outside the registries also reads: (is it used?, by what).
_ALSO_USED: dict[str, tuple[Callable[[AlgorithmConfig], bool], str]] = {
    "l_max": (lambda a: a.overlong.mode == "soft", "overlong.mode 'soft'"),
}


def _declared_knobs() -> list[Ignorable]:
    """One row per knob (the section, for a dotted knob) that a registered policy loss,
    advantage estimator, aggregation or off-policy correction declares: used iff the chosen
    entry declares it (or `_ALSO_USED` says so)."""
    from tiller.train.algorithms import ADVANTAGES, AGGREGATIONS, OFF_POLICY, POLICY_LOSSES

    rows: list[Ignorable] = []
    for field, registry in (("policy_loss", POLICY_LOSSES), ("advantage", ADVANTAGES),
                            ("aggregation", AGGREGATIONS), ("off_policy", OFF_POLICY)):
        roots = {knob.split(".")[0] for name in registry for knob in registry.knobs[name]}
        for knob in sorted(roots):
            also, also_who = _ALSO_USED.get(knob, (lambda a: False, ""))
            names = ", ".join(repr(n) for n in sorted(registry) if registry.declares(n, knob))
            also_by = f" and {also_who}" if also_who else ""
            rows.append((knob, _reads(field, registry, knob, also),
                         f"read only by {field} {names}{also_by}"))
    return rows


def _reads(field: str, registry: Any, knob: str, also: Callable[[AlgorithmConfig], bool]
           ) -> Callable[[AlgorithmConfig], bool]:
    """Is `knob` used: declared by the entry that `field` chooses, or `also` used."""
    return lambda a: registry.declares(getattr(a, field), knob) or also(a)


def _get(tree: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _pop(tree: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.get(key) or {}
    tree.pop(leaf, None)


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set a dotted key unless the tree already holds a value there (fills defaults only)."""
    *parents, leaf = dotted.split(".")
    for key in parents:
        if tree.get(key) is None:
            tree[key] = {}
        tree = tree[key]
    if tree.get(leaf) is None:
        tree[leaf] = value


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
    advantage: str = Field("grpo", description="grpo | dr_grpo | rloo | reinforce_pp | gae")
    policy_loss: str = Field("ppo_clip", description="ppo_clip | gspo | cispo | sapo")
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
    aggregation: str = Field("token-mean", description="token-mean | seq-mean-token-mean | "
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
    kl: KLConfig = Field(default_factory=KLConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    credit: CreditConfig = Field(default_factory=CreditConfig)
    critic: CriticConfig | None = Field(None, description="advantage 'gae' only")

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, name: str) -> str:
        from tiller.train.algorithms import ADVANTAGES

        return registered(name, ADVANTAGES)

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        from tiller.train.algorithms import POLICY_LOSSES

        return registered(name, POLICY_LOSSES)

    @field_validator("aggregation")
    @classmethod
    def _known_aggregation(cls, name: str) -> str:
        from tiller.train.algorithms import AGGREGATIONS

        return registered(name, AGGREGATIONS)

    @field_validator("off_policy")
    @classmethod
    def _known_off_policy(cls, name: str) -> str:
        from tiller.train.algorithms import OFF_POLICY

        return registered(name, OFF_POLICY)

    @model_validator(mode="wrap")
    @classmethod
    def _resolve(cls, data: Any, handler: Callable[[Any], AlgorithmConfig]) -> AlgorithmConfig:
        if not isinstance(data, dict):  # an instance (already resolved) or an assignment
            return handler(data)
        from tiller.train.presets import PRESETS

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
        merged = merge(base, user)
        typed = handler(merged)  # types and ranges first, so the rules below read clean values
        for knob, used, why in [*_declared_knobs(), *_IGNORABLE]:
            if _get(merged, knob) is None or used(typed):
                continue
            mine = _get(user, knob)
            if mine is not None:
                if isinstance(mine, dict):  # a section: name its first key
                    knob, mine = next(((f"{knob}.{k}", v) for k, v in mine.items()), (knob, mine))
                raise ConfigError(f"config field rl.algorithm.{knob}: got {mine!r}; the algorithm "
                                  f"ignores it: {why}")
            _pop(merged, knob)  # the preset's value for a part the overrides switched off
        typed = handler(merged)
        return handler(_fill_defaults(merged, typed))


def _fill_defaults(merged: dict[str, Any], a: AlgorithmConfig) -> dict[str, Any]:
    """The resolved values of the knobs this algorithm uses and the user left unset: the
    declared knobs of the policy loss and the off-policy correction get the function's own
    defaults (None stays unset: off)."""
    from tiller.train.algorithms import ADVANTAGES, OFF_POLICY, POLICY_LOSSES

    for registry, name in ((POLICY_LOSSES, a.policy_loss), (OFF_POLICY, a.off_policy)):
        params = inspect.signature(registry[name]).parameters
        for knob in registry.declared(name):
            if params[knob].default is not None:
                _put(merged, knob, params[knob].default)
    if a.kl.beta > 0:
        _put(merged, "kl.placement", "loss")
        if a.kl.placement in (None, "loss"):
            _put(merged, "kl.estimator", "k3")
    if a.dynamic_sampling.enabled:
        _put(merged, "dynamic_sampling.max_rounds", 3)
    if ADVANTAGES.declares(a.advantage, "critic"):
        merged["critic"] = merged.get("critic") or {}
    if _estimator_takes(a, "eps"):
        _put(merged, "advantage_eps", 1e-6)
    if _outcome_estimator(a):
        _put(merged, "credit.gamma_turn", 1.0)
        _put(merged, "credit.turn_baseline", "per_turn")
    return merged
