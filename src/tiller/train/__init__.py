"""Training: batches, the policy trainer (SFT and policy-gradient steps), the PPO critic,
presets and the algorithm library (`train.algorithms`)."""
