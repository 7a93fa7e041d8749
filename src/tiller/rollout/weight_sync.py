"""Weight sync: versioned updates from the trainer to the engines.

The trainer publishes a `WeightUpdate` after each optimizer step; an engine applies it and
reports the new version on every generation, which is how a trajectory knows which policy
sampled it. A full update must cover every tensor of the receiving model exactly (same names,
same shapes); an update of a subset must say so (`partial=True`). Otherwise applying it fails
before any weight is written, so the receiver keeps its old weights and version. Tensors are
cast to the receiver's dtype and device (an fp32 trainer feeds a bf16 engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class WeightSyncError(ValueError):
    """An update that does not fit the receiving model; the message names the tensors."""


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    tensors: dict[str, torch.Tensor]
    partial: bool = False  # True: a subset of the model's tensors, the others stay as they are

    @classmethod
    def full(cls, model: nn.Module, version: int) -> WeightUpdate:
        """Every parameter and buffer, copied so later training steps cannot alter it."""
        return cls(version, {k: v.detach().clone() for k, v in model.state_dict().items()})

    def check(self, model: nn.Module) -> None:
        """Raise `WeightSyncError` naming the unexpected, missing (full updates only) and
        mis-shaped tensors, if any."""
        own = model.state_dict()
        problems = []
        unexpected = sorted(set(self.tensors) - set(own))
        if unexpected:
            problems.append(f"tensors the model lacks: {_names(unexpected)}")
        missing = [] if self.partial else sorted(set(own) - set(self.tensors))
        if missing:
            problems.append(f"missing tensors (a full update must cover the model; pass "
                            f"partial=True for a subset): {_names(missing)}")
        shapes = [f"{k} {tuple(v.shape)} vs the model's {tuple(own[k].shape)}"
                  for k, v in self.tensors.items() if k in own and v.shape != own[k].shape]
        if shapes:
            problems.append(f"shape mismatch: {_names(shapes)}")
        if problems:
            raise WeightSyncError(f"weight update v{self.version} does not fit the model: "
                                  + "; ".join(problems))

    @torch.no_grad()
    def apply_to(self, model: nn.Module) -> None:
        """Copy the tensors into `model` (cast to its dtype and device) after `check`."""
        self.check(model)
        model.load_state_dict(self.tensors, strict=False)


def _names(items: list[str], shown: int = 5) -> str:
    more = f" (and {len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
