"""Training: batches, the policy trainer (SFT and policy-gradient steps), the PPO critic,
reward shaping and judges; the algorithm library it calls is its own box, `tiller.algorithms`."""
