"""Rollout: episodes (the agent loop, chat formats, the trajectory they produce, collection,
memory) and the RL schedule that keeps them running for the trainer (the rollout manager, the
curriculum, the data buffer). The engine they sample from is `tiller.engine`."""
