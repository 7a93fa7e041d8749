"""Algorithm presets: named combinations of the algorithm knobs, as the papers define them.

A preset is a set of defaults for `rl.algorithm`: `preset: dapo` plus any override the user writes
(the override wins). Knobs a preset leaves out keep their plain defaults; knobs the final
algorithm ignores must stay unset (see `config.AlgorithmConfig`). Each entry names its source.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (Shao et al., 2024): group-normalized advantage, PPO clip 0.2, per-sequence
    # token mean, k3 KL in the loss with beta = 0.04.
    "grpo": {
        "advantage": "grpo", "policy_loss": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2,
        "aggregation": "seq-mean-token-mean",
        "kl": {"beta": 0.04, "placement": "loss", "estimator": "k3"},
    },
    # DAPO (Yu et al., 2025): clip-higher 0.2 / 0.28, dynamic sampling, token-level loss,
    # no KL, soft overlong punishment (L_cache = 20% of L_max, as 4096 of 20480 in the paper).
    "dapo": {
        "advantage": "grpo", "policy_loss": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28,
        "aggregation": "token-mean", "kl": {"beta": 0.0},
        "dynamic_sampling": {"enabled": True, "max_rounds": 3},
        "overlong": {"mode": "soft"},
    },
    # Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): no std scaling, no
    # length normalization (sum over tokens divided by a constant L_max), no KL.
    "dr_grpo": {
        "advantage": "dr_grpo", "policy_loss": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2,
        "aggregation": "seq-mean-token-sum-norm", "kl": {"beta": 0.0},
    },
    # GSPO (Zheng et al., 2025): sequence-level ratio clipped to 1 - 3e-4 / 1 + 4e-4, the
    # objective averaged per sequence (seq-mean-token-mean), group-normalized advantage, no KL.
    "gspo": {
        "advantage": "grpo", "policy_loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4,
        "aggregation": "seq-mean-token-mean", "kl": {"beta": 0.0},
    },
    # PPO for LLMs (Ouyang et al., 2022; OpenRLHF defaults): critic + GAE (gamma 1, lambda 0.95,
    # whitened), PPO clip 0.2, clipped value loss, per-token KL penalty in the reward.
    "ppo": {
        "advantage": "gae", "policy_loss": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2,
        "aggregation": "token-mean", "kl": {"beta": 0.01, "placement": "reward"},
        "critic": {"gamma": 1.0, "lam": 0.95, "value_clip": 0.2, "whiten": True},
    },
    # RLOO (Ahmadian et al., 2024, "Back to Basics"): leave-one-out baseline, a sequence-level
    # REINFORCE loss (log-prob summed over the sequence), KL in the reward (beta 0.05 as in TRL).
    "rloo": {
        "advantage": "rloo", "policy_loss": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2,
        "aggregation": "seq-mean-token-sum", "kl": {"beta": 0.05, "placement": "reward"},
    },
    # REINFORCE++-baseline (Hu et al., 2025): group mean subtracted, whitened over the batch's
    # tokens, PPO clip 0.2, token-level loss, KL in the reward (beta 0.01, OpenRLHF's default).
    "reinforce_pp": {
        "advantage": "reinforce_pp", "policy_loss": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2,
        "aggregation": "token-mean", "kl": {"beta": 0.01, "placement": "reward"},
    },
}
