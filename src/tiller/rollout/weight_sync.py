"""Weight sync: versioned updates from the trainer to the engines.

The trainer publishes a `WeightUpdate` after each optimizer step; an engine applies it and
reports the new version on every generation, which is how a trajectory knows which policy
sampled it. A full update must cover every tensor of the receiving model exactly (same names,
same shapes); an update of a subset must say so (`partial=True`). Otherwise applying it fails
before any weight is written, so the receiver keeps its old weights and version. Tensors are
cast to the receiver's dtype and device (an fp32 trainer feeds a bf16 engine).

Checksums: the sender may attach, per tensor, a float64 sum of the values the receiver must hold
(in its dtype) at 1024 fixed, seeded positions (`checksum_positions`); the receiver recomputes
them after applying and raises `WeightSyncError` naming the version and the first tensor that
differs. This catches an update applied to the wrong tensor, a tensor left out or not written, a
wrong cast, and corruption of most elements of a tensor (in flight or on disk). It does not see a
change confined to positions it does not sample (e.g. one element) nor one that keeps the sum
(a swap of two sampled values): the parity check after every sync (`sync.WeightSync`) is the
end-to-end guard.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tiller.files import replacing, write_file

CHECKSUM_RUNS, CHECKSUM_RUN = 16, 64  # per tensor: 16 runs of 64 consecutive elements
_positions: dict[tuple[int, str], torch.Tensor] = {}  # (numel, device) -> sampled positions


class WeightSyncError(ValueError):
    """An update that does not fit the receiving model, or a sync that did not arrive intact;
    the message names the version and the tensors."""


def checksum_positions(numel: int, device: torch.device) -> torch.Tensor:
    """The fixed positions a tensor of `numel` elements is checksummed at: every one when there
    are at most 1024, else 16 runs of 64 consecutive elements at offsets drawn with seed
    `numel` (sender and receiver draw the same ones without exchanging them). Runs, not 1024
    scattered elements: each costs a few cache lines instead of 64 misses."""
    key = (numel, str(device))
    if key not in _positions:
        if numel <= CHECKSUM_RUNS * CHECKSUM_RUN:
            pos = torch.arange(numel)
        else:
            gen = torch.Generator().manual_seed(numel)
            starts = torch.randint(0, numel - CHECKSUM_RUN + 1, (CHECKSUM_RUNS,), generator=gen)
            pos = (starts.sort().values[:, None] + torch.arange(CHECKSUM_RUN)).reshape(-1)
        _positions[key] = pos.to(device)
    return _positions[key]


@torch.no_grad()
def checksums(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None
              ) -> dict[str, float]:
    """Per tensor, the float64 sum of its values (floating ones cast to `dtype` first, as the
    receiver will hold them) at `checksum_positions`. One gather per tensor into a shared
    buffer, then one cast, one sum and one host sync per source dtype: a few microseconds a
    tensor, so checksumming stays small next to the copy it guards."""
    width = CHECKSUM_RUNS * CHECKSUM_RUN
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault((t.dtype, t.device), []).append(name)
    sums: dict[str, float] = {}
    for (source, device), names in groups.items():
        buf = torch.zeros(len(names) * width, dtype=source, device=device)
        for i, name in enumerate(names):
            flat = tensors[name].detach().reshape(-1)
            pos = checksum_positions(flat.numel(), device)
            torch.index_select(flat, 0, pos, out=buf[i * width:i * width + pos.numel()])
        values = buf.view(len(names), width)
        if dtype is not None and values.is_floating_point():
            values = values.to(dtype)
        sums.update(zip(names, values.to(torch.float64).sum(1).tolist(), strict=True))
    return {name: sums[name] for name in tensors}


def verify_checksums(own: dict[str, torch.Tensor], expected: dict[str, float],
                     version: int) -> None:
    """Raise `WeightSyncError` naming the version and the first tensor of `own` (a model's
    state dict) whose checksum differs from `expected` (beyond float64 rounding of the sum;
    NaN matches only NaN)."""
    missing = sorted(set(expected) - set(own))
    if missing:
        raise WeightSyncError(f"weight update v{version}: checksums name tensors the model "
                              f"lacks: {_names(missing)}")
    got = checksums({k: own[k] for k in expected})
    for name, want in expected.items():
        have = got[name]
        same = (math.isnan(want) and math.isnan(have)) or abs(have - want) <= 1e-9 * max(
            1.0, abs(want), abs(have))
        if not same:
            raise WeightSyncError(f"weight update v{version}: tensor {name} does not hold what "
                                  f"was sent after applying (checksum {have!r}, the sender's "
                                  f"{want!r}): the update was corrupted or not applied")


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    tensors: dict[str, torch.Tensor]
    partial: bool = False  # True: a subset of the model's tensors, the others stay as they are
    checksums: dict[str, float] | None = None  # see `checksums`; verified after applying

    @classmethod
    def full(cls, model: nn.Module, version: int) -> WeightUpdate:
        """Every parameter and buffer, copied so later training steps cannot alter it."""
        return cls(version, {k: v.detach().clone() for k, v in model.state_dict().items()})

    def save(self, folder: str | Path) -> Path:
        """Write the tensors to `folder/model.safetensors` and the version (and checksums) to
        `folder/tiller_version.json` (what `tiller serve`'s /update_weights_from_disk reads).
        Names sharing one storage (tied embeddings) are written once; `load` fills them in."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        seen: set[int] = set()
        out = {}
        for k, v in self.tensors.items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                out[k] = v.detach().contiguous().cpu()
        with replacing(folder / "model.safetensors") as new:
            save_file(out, str(new))
        write_file(folder / "tiller_version.json", json.dumps(
            {"version": self.version, "kind": "full", "partial": self.partial,
             "checksums": self.checksums}))
        return folder

    @classmethod
    def load(cls, folder: str | Path, version: int, model: nn.Module,
             files: list[Path] | None = None, checksums: dict[str, float] | None = None
             ) -> WeightUpdate:
        """Every `*.safetensors` file in `folder` (a `save` or an HF `save_pretrained`
        checkpoint), or exactly `files` when given (paths a caller already checked), as a full
        update of `model` (verified against `checksums` after applying, when given). Names the
        model ties to a tensor in the files (lm_head to the embeddings) may be absent; anything
        else that does not fit raises `WeightSyncError` before a weight is written."""
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
        update = cls(version, tensors, checksums=checksums)
        update.check(model)
        return update

    def check(self, model: nn.Module) -> None:
        """Raise `WeightSyncError` naming the unexpected, missing (full updates only) and
        mis-shaped tensors, if any."""
        self._check(model.state_dict())

    def _check(self, own: dict[str, torch.Tensor]) -> None:
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
        """Copy the tensors into `model` (cast to its dtype and device) after `check`: one
        in-place `copy_` per tensor, where tied names sharing a source and a target are written
        once, then verify the checksums if the update has them."""
        own = model.state_dict()
        self._check(own)
        written: set[tuple[int, int]] = set()
        # in the model's order, as load_state_dict: of tied names given different values (two
        # clones), the last wins, whatever order the update's dict (or its file) has
        for name, target in own.items():
            if name not in self.tensors:
                continue
            src = self.tensors[name]
            pair = (target.data_ptr(), src.data_ptr())
            if pair not in written:
                written.add(pair)
                target.copy_(src)
        if self.checksums is not None:
            verify_checksums(own, self.checksums, self.version)


def _names(items: list[str], shown: int = 5) -> str:
    more = f" (and {len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
