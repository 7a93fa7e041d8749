"""Rollout: the engine that samples, the agent loop that runs episodes, chat formats, the
trajectory they produce and the weight updates the engine receives."""
