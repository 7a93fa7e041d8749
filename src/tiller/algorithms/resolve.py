"""Resolving `rl.algorithm` against the registries: which knobs the chosen algorithm reads, the
ignored-knob rule and the defaults of the knobs it reads (docs/algorithms.md).

The config (`tiller.config.AlgorithmConfig`) merges the preset under the user's keys and calls
`resolve`; everything here reads the registries next door, so adding an estimator or a loss
(one function, one decorator declaring its knobs) needs no change here. The config section is
read by attribute (`a.kl.beta`): this box sits below the config and does not import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from tiller.algorithms.registry import ADVANTAGES, AGGREGATIONS, OFF_POLICY, POLICY_LOSSES
from tiller.errors import ConfigError

# an AlgorithmConfig (tiller.config.algorithm), read by attribute
Algorithm = Any


def estimator_takes(a: Algorithm, name: str) -> bool:
    """Whether the chosen advantage estimator declares input `name`."""
    return name in ADVANTAGES.inputs[a.advantage]


def outcome_estimator(a: Algorithm) -> bool:
    """Turn-level credit wraps estimators of outcome rewards (those that declare `rewards`)."""
    return estimator_takes(a, "rewards")


# An ignorable knob: (dotted name, is it used by this algorithm?, what uses it). A knob the final
# algorithm ignores must stay unset: setting it is an error naming it, never a silent no-op.
# The knobs of losses, estimators and aggregations come from their registry declarations
# (`declared_knobs`); these are the others.
Ignorable = tuple[str, Callable[[Algorithm], bool], str]

IGNORABLE: list[Ignorable] = [
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
    ("advantage_eps", lambda a: estimator_takes(a, "eps"),
     "used only by estimators that divide by a std (grpo, reinforce_pp, gae)"),
    ("credit.gamma_turn", outcome_estimator, "used only by outcome-reward estimators (a "
     "per-token estimator such as gae takes turn rewards per token, discounted by critic.gamma)"),
    ("credit.turn_baseline", outcome_estimator,
     "used only by outcome-reward estimators (gae's baseline is its critic)"),
]

# Declared knobs that something outside the registries also reads: (is it used?, by what).
_ALSO_USED: dict[str, tuple[Callable[[Algorithm], bool], str]] = {
    "l_max": (lambda a: a.overlong.mode == "soft", "overlong.mode 'soft'"),
}


def declared_knobs() -> list[Ignorable]:
    """One row per knob (the section, for a dotted knob) that a registered policy loss,
    advantage estimator, aggregation or off-policy correction declares: used iff the chosen
    entry declares it (or `_ALSO_USED` says so)."""
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


def _reads(field: str, registry: Any, knob: str, also: Callable[[Algorithm], bool]
           ) -> Callable[[Algorithm], bool]:
    """Is `knob` used: declared by the entry that `field` chooses, or `also` used."""
    return lambda a: registry.declares(getattr(a, field), knob) or also(a)


def resolve(user: dict[str, Any], merged: dict[str, Any], validate: Callable[[Any], Algorithm]
            ) -> Algorithm:
    """The resolved algorithm of `merged` (the preset's keys under the `user`'s): a knob the
    algorithm ignores is a ConfigError if the user set it (a preset's own value is dropped),
    and the unset knobs it reads get their defaults. `validate` types a dict (the section's
    plain validation, without this resolution)."""
    typed = validate(merged)  # types and ranges first, so the rules below read clean values
    for knob, used, why in [*declared_knobs(), *IGNORABLE]:
        if _get(merged, knob) is None or used(typed):
            continue
        mine = _get(user, knob)
        if mine is not None:
            if isinstance(mine, dict):  # a section: name its first key
                knob, mine = next(((f"{knob}.{k}", v) for k, v in mine.items()), (knob, mine))
            raise ConfigError(f"config field rl.algorithm.{knob}: got {mine!r}; the algorithm "
                              f"ignores it: {why}")
        _pop(merged, knob)  # the preset's value for a part the overrides switched off
    return validate(fill_defaults(merged, validate(merged)))


def fill_defaults(merged: dict[str, Any], a: Algorithm) -> dict[str, Any]:
    """The resolved values of the knobs this algorithm uses and the user left unset: the
    declared knobs of the policy loss and the off-policy correction get the function's own
    defaults (None stays unset: off)."""
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
    if estimator_takes(a, "eps"):
        _put(merged, "advantage_eps", 1e-6)
    if outcome_estimator(a):
        _put(merged, "credit.gamma_turn", 1.0)
        _put(merged, "credit.turn_baseline", "per_turn")
    return merged


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
