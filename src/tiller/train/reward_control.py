"""The spurious-reward control (`rl.reward_control`): train on a reward that carries no
information about what the policy did, with everything else of the run unchanged.

If RL on such a reward "improves" held-out success as much as the verifier's reward does, the
gain came from the RL update itself (e.g. sharpening behaviour the model already had), not
from the reward. docs/evaluation.md says why this matters and how to read the result.

- `random`: per RL step, the verifier values of the step's trajectories are permuted across
  all of them (a seeded permutation of the whole batch, across groups). The batch's mean and
  distribution of rewards are exactly the real ones; which trajectory gets which value is
  independent of its behaviour.
- `constant`: every trajectory gets the same value. An estimator with a group baseline (grpo,
  rloo, dr_grpo, ...) then computes advantage 0 everywhere: the policy-gradient term is 0, and
  the weights move only through the terms that do not use the reward (KL, entropy bonus).

Only the value RL trains on changes: the rollout manager's group statistics, the dynamic
sampling filter, the logged reward/success metrics and every evaluation see the verifier's
value, so a controlled run keeps the same data selection and shows its real success.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiller.envs.verifiers import Reward
from tiller.errors import RunError


class RewardControl:
    """`apply(rewards, step)` -> the verifier values RL trains on at that step, given the
    verifier's rewards of the step's trajectories, in batch order."""

    def __init__(self, mode: str, value: float | None, seed: int):
        self.mode, self.seed = mode, seed
        self.value = 0.0 if value is None else value

    def apply(self, rewards: Sequence[Reward], step: int) -> list[float]:
        real = [r.value for r in rewards]
        if self.mode == "none":
            return real
        if any(r.turn_rewards is not None for r in rewards):
            # turn rewards go to the advantage estimator untouched: they would carry the real
            # signal past the control, so the run stops instead of reporting a false control
            raise RunError(f"rl step {step + 1}: rl.reward_control={self.mode}, but the env's "
                           "verifier gives turn rewards, which the control does not replace")
        if self.mode == "constant":
            return [self.value] * len(real)
        # one generator per (run seed, step): the same run permutes the same way every time
        order = np.random.default_rng([self.seed, step]).permutation(len(real))
        return [real[i] for i in order]

    def metrics(self, rewards: Sequence[Reward], values: Sequence[float]) -> dict[str, float]:
        """What the control did this step: the mean trained value and the share of
        trajectories whose trained value equals their verifier value."""
        if self.mode == "none" or not values:
            return {}
        same = sum(v == r.value for r, v in zip(rewards, values, strict=True))
        return {"reward_control/trained_mean": float(np.mean(values)),
                "reward_control/agree_frac": same / len(values)}
