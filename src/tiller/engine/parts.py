"""Per-rank weight updates (weight_sync.shards: per_rank): each trainer rank writes its own
shard's part of a version, and a server applies the version only once every part is there.

A rank's part (`ShardPart`, the file `part-<rank>.safetensors` in the version's folder) holds,
per tensor, the range of the full tensor's flat positions the rank owns (FSDP2 shards every
parameter on dim 0, so a rank's shard is one run of whole rows: `start`, `count`) and either
all of its values (a full part) or only those whose engine-dtype bits changed since the last
sync (a delta part: varint gaps of the full tensor's positions and their values,
`tiller.engine.delta`), plus its share of each tensor's checksum (the sum of its values at
the tensor's `updates.checksum_positions` inside its range: the ranks' shares add up to the
whole tensor's checksum). Rank 0 also owns the buffers, whole.

The version's `tiller_version.json` (kind "parts", written by rank 0 after every rank wrote
its part) says how many parts there are and, when any part is a delta, the base version they
change. `PartsUpdate.load` refuses the version whole, nothing applied, when a part is missing
(naming the rank), a part is of another version, or the parts' ranges do not tile every tensor
of the model exactly; the writes of all parts are then checked against the summed checksums
and applied at one safe point (`StagedUpdate`), so no server ever serves a half-updated
version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tiller.engine.delta import MAX_VARINT_BYTES, TensorDelta, bits, encode_gaps
from tiller.engine.updates import (
    Count,
    StagedUpdate,
    VersionFile,
    WeightSyncError,
    Write,
    _names,
    checksum_positions,
    malformed,
)
from tiller.files import replacing, write_file


def part_name(rank: int) -> str:
    return f"part-{rank}.safetensors"


@dataclass(frozen=True)
class Range:
    """The flat positions [start, start + count) of a tensor of `numel` elements."""

    numel: int
    start: int
    count: int


@torch.no_grad()
def shard_range(param: torch.Tensor, rank: int, world: int) -> tuple[Range, torch.Tensor]:
    """`param`'s range on rank `rank` and its local values: an FSDP2 parameter (a DTensor
    sharded on dim 0 like `torch.chunk`: rows [rank * ceil(rows / world), ...)), or a plain
    tensor, which the rank holds whole."""
    if not hasattr(param, "to_local"):
        return Range(param.numel(), 0, param.numel()), param.detach()
    local = param.to_local().detach()
    rows = param.shape[0] if param.dim() else 1
    chunk = -(-rows // world)
    first = min(rank * chunk, rows)
    if local.shape[0] != max(0, min(chunk, rows - first)) or local.shape[1:] != param.shape[1:]:
        raise RuntimeError(f"trainer rank {rank}: a shard of shape {tuple(local.shape)} is not "
                           f"rows [{first}, {first + chunk}) of {tuple(param.shape)}")
    per_row = param.numel() // rows if rows else 0
    return Range(param.numel(), first * per_row, local.numel()), local


class ShardCopy:
    """One rank's copy, in the engine's dtype, of what the engine holds of its shard (the
    sender's side: a delta is diffed against it, so after any number of deltas the engine holds
    what a full sync would give, bit for bit)."""

    def __init__(self, model: nn.Module, rank: int, world: int):
        self.rank, self.world = rank, world
        keys = set(model.state_dict())
        self.live = dict(model.named_parameters())  # tied names once: one storage each
        if rank == 0:  # the buffers a state dict holds are replicated: rank 0 sends them
            self.live.update((n, b) for n, b in model.named_buffers() if n in keys)
        self.synced: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def write(self, path: Path, root: Path, version: int, base: int | None,
              dtype: torch.dtype, mode: str) -> dict[str, float]:
        """This rank's part of `version` written to `path` (below `root`): full when `base` is
        None, else a delta against `base` (mode delta) or whichever is fewer bytes (auto); its
        figures (bytes, full_bytes, changed, numel, delta 0/1)."""
        tensors: dict[str, torch.Tensor] = {}
        ranges: dict[str, list[int]] = {}
        sums: dict[str, float] = {}
        local: dict[str, tuple[Range, torch.Tensor]] = {}
        for name, p in self.live.items():
            where, values = shard_range(p, self.rank, self.world)
            local[name] = (where, values.to(dtype) if values.is_floating_point() else values)
        fresh = self.synced is None or base is None
        if fresh:
            self.synced = {n: v.reshape(-1).clone() for n, (_, v) in local.items()}
        full_bytes = sum(t.numel() * t.element_size() for t in self.synced.values())
        changed = numel = delta_bytes = 0
        deltas: dict[str, TensorDelta] = {}
        for name, (where, values) in local.items():
            new, old = values.reshape(-1), self.synced[name]
            numel += new.numel()
            if not fresh:
                idx = torch.nonzero(bits(new) != bits(old))[:, 0]
                old[idx] = new[idx]  # the synced copy is now `version`
                changed += idx.numel()
                d = TensorDelta(where.numel, torch.from_numpy(encode_gaps(
                    (idx + where.start).numpy())), new[idx].clone())
                deltas[name] = d
                delta_bytes += d.nbytes
            ranges[name] = [where.numel, where.start, where.count]
            sums[name] = range_sum(old, where)
        delta = not fresh and (mode == "delta" or delta_bytes < full_bytes)
        for name in local:
            if delta:
                tensors[f"{name}/idx"] = deltas[name].index_bytes.contiguous()
                tensors[f"{name}/val"] = deltas[name].values.contiguous()
            else:
                tensors[f"{name}/val"] = self.synced[name].contiguous()
        meta = {"rank": self.rank, "version": version, "base_version": base if delta else None,
                "ranges": ranges, "checksums": sums}
        with replacing(path, root=root) as new_path:
            save_file(tensors, str(new_path), metadata={"tiller_part": json.dumps(meta)})
        return {"bytes": float(delta_bytes if delta else full_bytes),
                "full_bytes": float(full_bytes), "changed": float(changed if not fresh else numel),
                "numel": float(numel), "delta": float(delta)}


def range_sum(flat: torch.Tensor, where: Range) -> float:
    """The float64 sum of a tensor's values at its checksum positions inside `where`
    (`flat`: the values of the range, in the engine's dtype)."""
    pos = checksum_positions(where.numel, flat.device)
    inside = pos[(pos >= where.start) & (pos < where.start + where.count)] - where.start
    return float(flat[inside].to(torch.float64).sum())


class PartMeta(BaseModel):
    """A part's `tiller_part` metadata, as `ShardCopy.write` writes it. Strict: a wrong type or
    shape, an unknown key, a range past its tensor's end, a tensor with a range and no checksum
    (or the reverse) is refused, never guessed."""

    model_config = ConfigDict(extra="forbid", strict=True)
    rank: Count
    version: Count
    base_version: Count | None  # None: a full part; else the version its delta changes
    ranges: dict[str, tuple[Count, Count, Count]]  # per tensor: numel, start, count
    checksums: dict[str, float]  # per tensor: its share of the tensor's checksum

    @model_validator(mode="after")
    def _consistent(self) -> PartMeta:
        if set(self.ranges) != set(self.checksums):
            odd = sorted(set(self.ranges) ^ set(self.checksums))
            raise ValueError(f"ranges and checksums name other tensors ({_names(odd)})")
        past = [n for n, (numel, start, count) in self.ranges.items() if start + count > numel]
        if past:
            raise ValueError(f"the range of {_names(past)} ends past the tensor's numel")
        return self


@dataclass(frozen=True)
class Part:
    """One rank's part as read from its file: its metadata and tensors."""

    meta: PartMeta
    tensors: dict[str, torch.Tensor]


def read_part(path: Path, rank: int) -> Part:
    """Rank `rank`'s part in the file at `path`: its metadata validated (`PartMeta`) and its
    tensors' names and sizes checked against it from the file's header before any is read
    (`/val` per tensor, and `/idx` in a delta part); WeightSyncError naming the file and the
    first problems otherwise."""
    what = f"{part_name(rank)} (trainer rank {rank}'s part)"
    with safe_open(str(path), "pt") as f:
        raw = (f.metadata() or {}).get("tiller_part")
        if raw is None:
            raise WeightSyncError(f"{what} has no tiller_part metadata")
        try:
            meta = PartMeta.model_validate_json(raw)
        except ValidationError as e:
            raise WeightSyncError(malformed(f"{what} tiller_part metadata", e,
                                            "the metadata")) from e
        if meta.rank != rank:
            raise WeightSyncError(f"{what} says it is trainer rank {meta.rank}'s")
        delta = meta.base_version is not None
        keys = set(f.keys())
        want = {f"{n}/{kind}" for n in meta.ranges for kind in (("val", "idx") if delta
                                                                 else ("val",))}
        if keys != want:
            odd = [f"{which} {_names(sorted(names))}" for which, names in
                   (("missing", want - keys), ("unexpected", keys - want)) if names]
            raise WeightSyncError(f"{what}: its tensors are not its ranges' "
                                  f"{'/idx and /val' if delta else '/val'}: {'; '.join(odd)}")
        for name, (_, _, count) in meta.ranges.items():
            # a full part: every value of its range; a delta: at most that, and its positions
            # in varints of at most MAX_VARINT_BYTES each
            most = {"val": count, **({"idx": MAX_VARINT_BYTES * count} if delta else {})}
            for kind, limit in most.items():
                shape = f.get_slice(f"{name}/{kind}").get_shape()
                if len(shape) != 1 or shape[0] > limit or not delta and shape[0] != limit:
                    raise WeightSyncError(f"{what}: {name}/{kind} has shape {shape} for a "
                                          f"range of {count} elements")
        tensors = {k: f.get_tensor(k) for k in keys}
    return Part(meta, tensors)


@dataclass(frozen=True)
class PartsUpdate:
    """Version `version` in `parts` per-rank parts (the files beside its tiller_version.json);
    `base_version`: what the delta parts among them change (None: every part is full). The
    receiver's holds the parts it read (`loaded`, by rank) and the sender's version (`sent`)."""

    version: int
    base_version: int | None
    parts: int
    loaded: tuple[Part, ...] = ()
    sent: int | None = None

    def save(self, folder: str | Path, *, root: str | Path | None = None) -> Path:
        """The version's tiller_version.json (the ranks wrote their parts into `folder`)."""
        folder = Path(folder)
        write_file(folder / "tiller_version.json", json.dumps({
            "version": self.version, "kind": "parts", "parts": self.parts,
            "base_version": self.base_version}), root=folder if root is None else root)
        return folder

    @classmethod
    def load(cls, meta: VersionFile, files: dict[str, Path], version: int) -> PartsUpdate:
        """What the ranks and rank 0 wrote: `meta` (the version's tiller_version.json, read and
        validated) and the part files among `files` (by name, already checked paths); a part
        missing is a WeightSyncError naming its rank, nothing applied."""
        if meta.kind != "parts" or meta.parts is None:
            raise WeightSyncError(f"tiller_version.json says kind {meta.kind!r}, not parts")
        missing = [r for r in range(meta.parts) if part_name(r) not in files]
        if missing:
            raise WeightSyncError(f"update v{version}: the part of trainer rank(s) {missing} "
                                  f"({', '.join(part_name(r) for r in missing)}) is missing: "
                                  "nothing applied")
        loaded = tuple(read_part(files[part_name(r)], r) for r in range(meta.parts))
        return cls(version, meta.base_version, meta.parts, loaded, meta.version)

    def stage(self, model: nn.Module) -> StagedUpdate:
        """The parts checked whole against `model` and their writes decided, nothing written:
        every part of the sender's version, its delta (if any) against the update's base, its
        ranges inside the model's tensors and together tiling each exactly, its values in the
        model's dtype. `WeightSyncError` naming the first problem's rank otherwise."""
        own = model.state_dict()
        if len(self.loaded) != self.parts:
            raise WeightSyncError(f"update v{self.version}: {len(self.loaded)} parts read of "
                                  f"{self.parts}")
        writes: list[Write] = []
        sums: dict[str, float] = {}
        covered: dict[str, list[tuple[int, int]]] = {}
        for rank, part in enumerate(self.loaded):
            meta = part.meta
            if self.sent is not None and meta.version != self.sent:
                raise WeightSyncError(f"update v{self.version}: trainer rank {rank}'s part is "
                                      f"of v{meta.version}, not v{self.sent}")
            base = meta.base_version
            if base is not None and base != self.base_version:
                raise WeightSyncError(f"update v{self.version}: trainer rank {rank}'s part is "
                                      f"a delta against v{base}, the update's base is "
                                      f"v{self.base_version}")
            for name, (numel, start, count) in meta.ranges.items():
                if name not in own:
                    raise WeightSyncError(f"update v{self.version}: trainer rank {rank}'s part "
                                          f"names {name}, which the model lacks")
                target = own[name]
                if numel != target.numel():  # inside [0, numel]: `PartMeta`
                    raise WeightSyncError(f"update v{self.version}: trainer rank {rank}'s "
                                          f"range of {name} does not fit its "
                                          f"{target.numel()} elements")
                covered.setdefault(name, []).append((start, count))
                sums[name] = sums.get(name, 0.0) + meta.checksums[name]
                write = part_write(part, name, target, Range(numel, start, count),
                                   base is not None, rank)
                if write is not None:
                    writes.append(write)
        check_tiled(own, covered, self.version)
        return StagedUpdate(self.version, own, writes, sums)


def part_write(part: Part, name: str, target: torch.Tensor, where: Range, delta: bool,
               rank: int) -> Write | None:
    """One tensor's write from a rank's part (None: nothing to write)."""
    try:
        values = part.tensors[f"{name}/val"]
        if values.dtype != target.dtype:
            raise ValueError(f"values in {values.dtype} for the model's {target.dtype}")
        if not delta:
            if values.dim() != 1 or values.numel() != where.count:
                raise ValueError(f"{values.numel()} values for a range of {where.count}")
            index = torch.arange(where.start, where.start + where.count, device=target.device)
        else:
            index, values = TensorDelta(where.numel, part.tensors[f"{name}/idx"],
                                        values).decoded(target)
            if index.numel() and (index[0] < where.start
                                  or index[-1] >= where.start + where.count):
                raise ValueError("positions outside the rank's range")
    except (ValueError, KeyError) as e:
        raise WeightSyncError(f"trainer rank {rank}'s part of {name} does not fit: "
                              f"{type(e).__name__}: {e}") from e
    return Write(target, values.to(target.device), index) if index.numel() else None


def check_tiled(own: dict[str, torch.Tensor], covered: dict[str, list[tuple[int, int]]],
                version: int) -> None:
    """Every storage of the model covered, by the ranges of one of its names, exactly once."""
    names: dict[int, list[str]] = {}
    for name, t in own.items():
        names.setdefault(t.data_ptr(), []).append(name)
    problems = []
    for group in names.values():
        given = [n for n in group if n in covered]
        if len(given) != 1:
            problems.append(f"{group[0]} (in {len(given)} names' ranges)")
            continue
        at = 0
        for start, count in sorted(covered[given[0]]):
            if start != at:  # a gap or an overlap
                at = -1
                break
            at += count
        if at != own[given[0]].numel():
            problems.append(f"{given[0]} (its ranges do not tile its "
                            f"{own[given[0]].numel()} elements)")
    if problems:
        raise WeightSyncError(f"update v{version}: the parts do not cover the model exactly: "
                              f"{_names(problems)}: nothing applied")
