"""Weight sync: versioned updates from the trainer to the engines.

The trainer publishes a `WeightUpdate` after each optimizer step; an engine applies it and
reports the new version on every generation, which is how a trajectory knows which policy
sampled it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    tensors: dict[str, torch.Tensor]

    @classmethod
    def full(cls, model: nn.Module, version: int) -> WeightUpdate:
        """Every parameter and buffer, copied so later training steps cannot alter it."""
        return cls(version, {k: v.detach().clone() for k, v in model.state_dict().items()})

    @torch.no_grad()
    def apply_to(self, model: nn.Module) -> None:
        missing, unexpected = model.load_state_dict(self.tensors, strict=False)
        if unexpected:
            raise ValueError(f"weight update has tensors the model lacks: {unexpected[:5]}")
