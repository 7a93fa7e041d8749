"""Weight sync: versioned updates from the trainer to the engines.

The trainer publishes a `WeightUpdate` after each optimizer step; an engine applies it and
reports the new version on every generation, which is how a trajectory knows which policy
sampled it. A full update must cover every tensor of the receiving model exactly (same names,
same shapes); an update of a subset must say so (`partial=True`). Otherwise applying it fails
before any weight is written, so the receiver keeps its old weights and version. Tensors are
cast to the receiver's dtype and device (an fp32 trainer feeds a bf16 engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
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

    def save(self, folder: str | Path) -> Path:
        """Write the tensors to `folder/model.safetensors` and the version to
        `folder/tiller_version.json` (what `tiller serve`'s /update_weights_from_disk reads)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.tensors.items()},
                  str(folder / "model.safetensors"))
        (folder / "tiller_version.json").write_text(
            json.dumps({"version": self.version, "partial": self.partial}))
        return folder

    @classmethod
    def load(cls, folder: str | Path, version: int, model: nn.Module,
             files: list[Path] | None = None) -> WeightUpdate:
        """Every `*.safetensors` file in `folder` (a `save` or an HF `save_pretrained`
        checkpoint), or exactly `files` when given (paths a caller already checked), as a full
        update of `model`. Names the model ties to a tensor in the files (lm_head to the
        embeddings) may be absent; anything else that does not fit raises `WeightSyncError`
        before a weight is written."""
        if files is None:
            files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"no *.safetensors file in {str(folder)!r}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        by_storage: dict[int, list[str]] = {}
        for name, t in model.state_dict().items():
            by_storage.setdefault(t.data_ptr(), []).append(name)
        for names in by_storage.values():  # tied names share one storage: fill the absent ones
            present = [n for n in names if n in tensors]
            for n in names:
                if n not in tensors and present:
                    tensors[n] = tensors[present[0]]
        update = cls(version, tensors)
        update.check(model)
        return update

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
