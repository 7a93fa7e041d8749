"""Resumable checkpoints (`tiller train --resume RUN_DIR`, docs/resume.md)."""

from __future__ import annotations

from pydantic import Field

from tiller.config.base import Section


class CheckpointConfig(Section):
    """When RL writes a resumable checkpoint to RUN_DIR/checkpoints/step-<N>: the model, the
    optimizer, the RNG states, the task stream's position, the rollouts' open groups, the
    curriculum's state, the ledger and the metrics' position, so a killed run continues
    where it stopped."""

    every: int = Field(0, ge=0, description="write one after every `every` RL steps (and after "
                       "the last one); 0: none. With train.world_size > 1 the ranks' "
                       "sharded state (the optimizer's, the KL reference model's, the critic's) "
                       "is gathered to rank 0 into it, and a resume hands it back to every "
                       "rank (under model.lora rank 0's reference adapter too). Under "
                       "cluster.backend ray a resume starts a fresh Ray instance (or connects "
                       "to cluster.address) and new rollout workers, and pushes the "
                       "checkpoint's weights to every engine (docs/resume.md)")
    keep: int = Field(2, ge=1, description="how many of the newest complete ones to keep; "
                      "older ones are removed once a newer one is complete")
