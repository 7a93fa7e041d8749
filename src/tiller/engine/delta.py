"""Delta weight updates: only the elements whose engine-dtype value changed since the last sync.

Per tensor, the changed positions (of the flattened tensor, ascending) are sent as gaps
(first index, then differences) in LEB128 varints: 7 bits per byte, high bit set on every byte
but a number's last. At RL learning rates a step changes a few percent of the bf16-rounded
weights, so most gaps are below 128 and cost one byte, against 4 for a raw int32 index. The new
values follow in the engine's dtype. Encoding and decoding are vectorized (numpy), never a
Python loop per element.

The sender (`sync.WeightSync`) diffs against its own copy of what the engine holds, so
the engine's weights after any number of deltas equal a full sync bit for bit.

A delta is checked whole before any element is written (`DeltaUpdate.stage`): every tensor's
name and size, its index bytes (complete varints), its positions (strictly ascending, inside
the tensor), one value per position, in the model's dtype (a delta carries bit patterns, so
it is never cast). A delta with one bad tensor is refused and changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tiller.engine.updates import StagedUpdate, WeightSyncError, Write, _names
from tiller.files import replacing, write_file

MAX_VARINT_BYTES = 10  # a uint64 needs at most 10 groups of 7 bits


def encode_gaps(indices: np.ndarray) -> np.ndarray:
    """Ascending int64 positions as LEB128 varints of their gaps (uint8)."""
    if indices.size == 0:
        return np.zeros(0, dtype=np.uint8)
    gaps = np.diff(indices.astype(np.uint64), prepend=np.uint64(0))
    nbytes = np.ones(gaps.size, dtype=np.int64)  # bytes each gap takes
    for k in range(1, MAX_VARINT_BYTES):
        nbytes += gaps >= np.uint64(1) << np.uint64(7 * k)
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    for k in range(int(nbytes.max())):  # byte k of every gap that has one
        has = nbytes > k
        chunk = (gaps[has] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (nbytes[has] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + k] = (chunk | more).astype(np.uint8)
    return out


def decode_gaps(data: np.ndarray) -> np.ndarray:
    """The int64 positions `encode_gaps` encoded."""
    if data.size == 0:
        return np.zeros(0, dtype=np.int64)
    if data[-1] & 0x80:
        raise ValueError("delta indices end inside a varint (the last byte has its high bit set)")
    last = (data & 0x80) == 0  # each gap's last byte
    starts = np.flatnonzero(np.concatenate([[True], last[:-1]]))
    k = np.arange(data.size) - np.repeat(starts, np.diff(np.append(starts, data.size)))
    if k.max() >= MAX_VARINT_BYTES:
        raise ValueError(f"a delta index varint is longer than {MAX_VARINT_BYTES} bytes")
    parts = (data & 0x7F).astype(np.uint64) << (7 * k).astype(np.uint64)
    gaps = np.bitwise_or.reduceat(parts, starts)
    return np.cumsum(gaps).astype(np.int64)


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bit pattern as integers of its width, so -0.0 != 0.0 and NaN == the same NaN."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's changed elements: `index_bytes` (uint8 varint gaps) and `values`."""

    numel: int
    index_bytes: torch.Tensor  # uint8, on the host
    values: torch.Tensor  # the engine's dtype, one per changed element

    @property
    def nbytes(self) -> int:
        return self.index_bytes.numel() + self.values.numel() * self.values.element_size()

    def decoded(self, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, values) to write into `target`, on its device; ValueError saying what
        does not fit it."""
        if self.numel != target.numel():
            raise ValueError(f"{self.numel} elements vs the model's {target.numel()}")
        for what, t in (("index bytes", self.index_bytes), ("values", self.values)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"its {what} are not a 1-D tensor")
        if self.index_bytes.dtype != torch.uint8:
            raise ValueError(f"its index bytes are {self.index_bytes.dtype}, not uint8")
        if self.values.dtype != target.dtype:
            raise ValueError(f"values in {self.values.dtype} for the model's {target.dtype} "
                             "(a delta is never cast)")
        idx = decode_gaps(self.index_bytes.cpu().numpy())
        if idx.size != self.values.numel():
            raise ValueError(f"{idx.size} positions for {self.values.numel()} values")
        if idx.size and (idx[0] < 0 or idx[-1] >= self.numel or (np.diff(idx) <= 0).any()):
            raise ValueError(f"positions not strictly ascending inside [0, {self.numel})")
        return torch.from_numpy(idx).to(target.device), self.values.to(target.device)


@dataclass(frozen=True)
class DeltaUpdate:
    """Version `version` as changes to version `base_version`, which the receiver must hold."""

    version: int
    base_version: int
    deltas: dict[str, TensorDelta]
    checksums: dict[str, float] | None = field(default=None)
    partial: bool = True  # the tensors not named keep their values

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.deltas.values())

    def check(self, model: nn.Module) -> None:
        """Raise `WeightSyncError` naming every tensor that does not fit the model (see
        `TensorDelta.decoded`)."""
        self.stage(model)

    def stage(self, model: nn.Module) -> StagedUpdate:
        """The delta checked whole against `model`, its writes decided, nothing written."""
        own = model.state_dict()
        problems, writes = [], []
        for name, d in self.deltas.items():
            if name not in own:
                problems.append(f"{name} (the model has no such tensor)")
                continue
            try:
                idx, values = d.decoded(own[name])
            except ValueError as e:
                problems.append(f"{name} ({e})")
                continue
            if idx.numel():
                writes.append(Write(own[name], values, idx))
        if problems:
            raise WeightSyncError(f"delta update v{self.version} does not fit the model: "
                                  f"{_names(problems)}")
        return StagedUpdate(self.version, own, writes, self.checksums)

    def apply_to(self, model: nn.Module) -> None:
        """Stage, verify and write (`StagedUpdate.apply`): all of it or, raising, none."""
        self.stage(model).apply()

    def save(self, folder: str | Path) -> Path:
        """`folder/delta.safetensors` (`<name>/idx`, `<name>/val` per tensor) and
        `folder/tiller_version.json` saying kind delta, the base version and the checksums."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for name, d in self.deltas.items():
            tensors[f"{name}/idx"] = d.index_bytes.contiguous()
            tensors[f"{name}/val"] = d.values.detach().contiguous().cpu()
        with replacing(folder / "delta.safetensors") as new:
            save_file(tensors, str(new))
        write_file(folder / "tiller_version.json", json.dumps({
            "version": self.version, "kind": "delta", "base_version": self.base_version,
            "numel": {k: d.numel for k, d in self.deltas.items()},
            "checksums": self.checksums}))
        return folder

    @classmethod
    def load(cls, folder: str | Path, meta: dict, version: int | None = None) -> DeltaUpdate:
        """What `save` wrote; `meta` is its tiller_version.json, already read."""
        raw = load_file(str(Path(folder) / "delta.safetensors"))
        deltas = {name: TensorDelta(int(n), raw[f"{name}/idx"], raw[f"{name}/val"])
                  for name, n in meta["numel"].items()}
        return cls(meta["version"] if version is None else version, int(meta["base_version"]),
                   deltas, meta.get("checksums"))
