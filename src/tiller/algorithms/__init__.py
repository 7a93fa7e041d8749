"""The algorithm library: estimators and losses of ALGORITHMS.md, registered by name.

Registries (config chooses by name): `ADVANTAGES`, `POLICY_LOSSES`, `KL_ESTIMATORS`,
`AGGREGATIONS`, `OFF_POLICY`. Helpers that are not chosen by name live in their modules:
`advantages` (GAE, whitening, value loss, overlong penalty), `kl`, `offpolicy` (mismatch and
staleness metrics), `credit`, `passk`. `presets` holds the named combinations (grpo, dapo, ...)
and `resolve` the rules `rl.algorithm` is resolved by: which knobs the chosen entries read, the
ignored-knob error and their defaults. This box imports nothing of tiller but `errors`, so the
config validates against it.
"""

from tiller.algorithms import advantages, aggregation, credit, kl, losses, offpolicy, passk  # noqa: F401
from tiller.algorithms.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    OFF_POLICY,
    POLICY_LOSSES,
    Registry,
)

__all__ = ["ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "OFF_POLICY", "POLICY_LOSSES",
           "Registry"]
