"""Weight sync: versioned updates from the trainer to the engines.

The trainer publishes a `WeightUpdate` after each optimizer step; an engine applies it and
reports the new version on every generation, which is how a trajectory knows which policy
sampled it. A full update must cover every tensor of the receiving model exactly (same names,
same shapes); an update of a subset must say so (`partial=True`). Floating tensors are cast to
the receiver's floating dtype and device (an fp32 trainer feeds a bf16 engine); any other tensor
must have the receiver's dtype exactly (an integer buffer is never cast from a float).

An update applies completely or not at all. `stage(model)` checks all of it against the model
(names, shapes, dtypes; for a delta every tensor's index bytes, bounds and value count) and
decides every write before one is done, raising one `WeightSyncError` that lists what does not
fit. `StagedUpdate.verify` then checks the checksums of what the model would hold after the
writes, still before writing; only `write` changes weights.

Checksums: the sender may attach, per tensor, a float64 sum of the values the receiver must hold
(in its dtype) at 1024 fixed, seeded positions (`checksum_positions`); the receiver predicts
them before writing (`verify`: a corrupted update is refused, nothing written) and recomputes
them after (`write`: a mismatch then is `WeightsInconsistent`, the weights are neither version).
This catches an update applied to the wrong tensor, a tensor left out or not written, a wrong
cast, and corruption of most elements of a tensor (in flight or on disk). It does not see a
change confined to positions it does not sample (e.g. one element) nor one that keeps the sum
(a swap of two sampled values): the parity check after every sync (`sync.WeightSync`) is the
end-to-end guard.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import load_file, save_file
from torch import nn

from tiller.files import remove_tree, replacing, write_file

CHECKSUM_RUNS, CHECKSUM_RUN = 16, 64  # per tensor: 16 runs of 64 consecutive elements
_positions: dict[tuple[int, str], torch.Tensor] = {}  # (numel, device) -> sampled positions
logger = logging.getLogger(__name__)


class WeightSyncError(ValueError):
    """An update that does not fit the receiving model, or a sync that did not arrive intact;
    the message names the version and the tensors. Raised before any weight is written, unless
    it is a `WeightsInconsistent`."""


class WeightsInconsistent(WeightSyncError):
    """Writing an update began and the result is not what was sent: the weights are neither
    the old version nor the new one (a bug or a hardware fault, never bad input): stop."""


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
    state dict) whose checksum differs from `expected`."""
    _check_names(own, expected, version)
    mismatch = _first_mismatch(checksums({k: own[k] for k in expected}), expected)
    if mismatch is not None:
        name, have, want = mismatch
        raise WeightSyncError(f"weight update v{version}: tensor {name} does not hold what "
                              f"was sent after applying (checksum {have!r}, the sender's "
                              f"{want!r}): the update was corrupted or not applied")


def _check_names(own: dict[str, torch.Tensor], expected: dict[str, float], version: int
                 ) -> None:
    missing = sorted(set(expected) - set(own))
    if missing:
        raise WeightSyncError(f"weight update v{version}: checksums name tensors the model "
                              f"lacks: {_names(missing)}")


def _first_mismatch(got: dict[str, float], expected: dict[str, float]
                    ) -> tuple[str, float, float] | None:
    """(name, got, expected) of the first checksum that differs beyond float64 rounding of the
    sum (NaN matches only NaN), else None."""
    for name, want in expected.items():
        have = got[name]
        same = (math.isnan(want) and math.isnan(have)) or abs(have - want) <= 1e-9 * max(
            1.0, abs(want), abs(have))
        if not same:
            return name, have, want
    return None


@dataclass(frozen=True)
class Write:
    """One write of a staged update: `values` into `target` (its flat positions `index`, or the
    whole tensor when None), already checked to fit."""

    target: torch.Tensor
    values: torch.Tensor
    index: torch.Tensor | None = None  # int64 on the target's device, strictly ascending

    @torch.no_grad()
    def apply(self) -> None:
        if self.index is None:
            self.target.copy_(self.values)
        else:
            self.target.view(-1)[self.index] = self.values

    @torch.no_grad()
    def overlay(self, pos: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """A partial write's target values at flat positions `pos` after it, given `current`,
        the values there before."""
        j = torch.searchsorted(self.index, pos).clamp_(max=self.index.numel() - 1)
        hit = self.index[j] == pos
        out = current.clone()
        out[hit] = self.values[j[hit]]
        return out


@dataclass
class StagedUpdate:
    """An update checked against one model with every write decided: nothing is written until
    `write`, and `verify` refuses a corrupted one before that."""

    version: int
    own: dict[str, torch.Tensor]  # the model's state dict (the tensors the writes target)
    writes: list[Write]
    checksums: dict[str, float] | None = None
    by_storage: dict[int, list[Write]] = field(init=False)

    def __post_init__(self) -> None:
        self.by_storage = {}
        for w in self.writes:  # tied names share a storage: the last write wins
            self.by_storage.setdefault(w.target.data_ptr(), []).append(w)

    @torch.no_grad()
    def verify(self) -> None:
        """Raise `WeightSyncError`, nothing written, when the checksums of what the model would
        hold after the writes differ from the sender's (at the model's current values, so call
        it where the update is applied)."""
        if self.checksums is None:
            return
        _check_names(self.own, self.checksums, self.version)
        # batched like the sender's: tensors no write touches, tensors a whole write replaces
        # (the last one, by target dtype, cast as copy_ will); a delta's partial writes are
        # laid over the current values one tensor at a time (an update's writes are all whole
        # or all partial)
        untouched: dict[str, torch.Tensor] = {}
        whole: dict[torch.dtype, dict[str, torch.Tensor]] = {}
        overlaid, sums = [], []
        for name in self.checksums:
            target = self.own[name]
            writes = self.by_storage.get(target.data_ptr(), [])
            if not writes:
                untouched[name] = target
            elif writes[-1].index is None:
                whole.setdefault(target.dtype, {})[name] = writes[-1].values
            else:
                flat = target.reshape(-1)
                pos = checksum_positions(flat.numel(), flat.device)
                values = flat[pos]
                for w in writes:
                    values = w.overlay(pos, values)
                overlaid.append(name)
                sums.append(values.to(torch.float64).sum())
        got = checksums(untouched)
        for dtype, group in whole.items():
            got.update(checksums(group, dtype))
        if sums:
            got.update(zip(overlaid, torch.stack(sums).tolist(), strict=True))
        mismatch = _first_mismatch(got, self.checksums)
        if mismatch is not None:
            name, have, want = mismatch
            raise WeightSyncError(f"weight update v{self.version}: tensor {name} would not "
                                  f"hold what was sent (checksum {have!r}, the sender's "
                                  f"{want!r}): the update was corrupted; nothing was applied")

    def apply(self) -> None:
        """`verify`, then `write`."""
        self.verify()
        self.write()

    def write(self) -> None:
        """Do every write, then verify the checksums (if any) on what the model holds; a
        mismatch now raises `WeightsInconsistent`."""
        for w in self.writes:
            w.apply()
        if self.checksums is not None:
            try:
                verify_checksums(self.own, self.checksums, self.version)
            except WeightSyncError as e:
                raise WeightsInconsistent(f"{e}; the weights are now neither version") from e


MAX_VERSION = 2**63 - 1  # versions and element counts fit an int64
Count = Annotated[int, Field(ge=0, le=MAX_VERSION)]


class VersionFile(BaseModel):
    """`tiller_version.json`, beside the tensors of an update on disk: what `WeightUpdate.save`
    and `DeltaUpdate.save` write and `tiller serve` reads (`parse`). Strict: a wrong type, a
    delta without its base or sizes, a key of the other kind or an unknown key is refused, never
    guessed; a checkpoint without the file is a full update."""

    model_config = ConfigDict(extra="forbid", strict=True)
    version: Count | None = None  # the sender's; `tiller serve` takes the request's
    kind: Literal["full", "delta", "parts"] = "full"
    partial: bool = False  # full: the tensors not named keep their values (a delta always)
    base_version: Count | None = None  # delta (and parts with a delta part): what it changes
    numel: dict[str, Count] | None = None  # delta: element count of each tensor it changes
    checksums: dict[str, float] | None = None  # per tensor (see `checksums`)
    parts: Annotated[int, Field(ge=1, le=4096)] | None = None  # parts: one per trainer rank

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> VersionFile:
        delta_fields = (self.base_version, self.numel)
        if self.kind == "delta" and None in delta_fields:
            raise ValueError("a delta needs base_version and numel")
        if self.kind == "full" and delta_fields != (None, None):
            raise ValueError("base_version and numel are a delta's (kind 'delta')")
        if (self.kind == "parts") != (self.parts is not None):
            raise ValueError("parts is the count of kind 'parts' (per-rank parts), and only it")
        if self.kind == "parts" and (self.numel, self.checksums) != (None, None):
            raise ValueError("numel and checksums of kind 'parts' are in each part")
        return self

    @classmethod
    def parse(cls, raw: bytes | None) -> VersionFile:
        """`raw` validated (None: there is no file); `WeightSyncError` with one line naming
        the first problems otherwise."""
        if raw is None:
            return cls()
        try:
            return cls.model_validate_json(raw)
        except ValidationError as e:
            raise WeightSyncError(malformed("tiller_version.json", e)) from e


def malformed(what: str, e: ValidationError, whole: str = "the file") -> str:
    """One line naming `what` and the first problems `e` found in it (`whole`: where a
    problem of no one key is; a key may hold newlines)."""
    problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or whole}: {err['msg']}"
                         for err in e.errors()[:3])
    return " ".join(f"{what} is malformed: {problems}".split())


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

    def save(self, folder: str | Path, *, root: str | Path | None = None) -> Path:
        """Write the tensors to `folder/model.safetensors` and the version (and checksums) to
        `folder/tiller_version.json` (what `tiller serve`'s /update_weights_from_disk reads),
        below `root` (no link among the folders between; default `folder` itself). Names
        sharing one storage (tied embeddings) are written once; `load` fills them in."""
        folder = Path(folder)
        root = folder if root is None else root
        seen: set[int] = set()
        out = {}
        for k, v in self.tensors.items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                out[k] = v.detach().contiguous().cpu()
        with replacing(folder / "model.safetensors", root=root) as new:
            save_file(out, str(new))
        write_file(folder / "tiller_version.json", json.dumps(
            {"version": self.version, "kind": "full", "partial": self.partial,
             "checksums": self.checksums}), root=root)
        return folder

    @classmethod
    def load(cls, folder: str | Path, version: int, model: nn.Module,
             files: list[Path] | None = None, checksums: dict[str, float] | None = None,
             partial: bool = False) -> WeightUpdate:
        """Every `*.safetensors` file in `folder` (a `save` or an HF `save_pretrained`
        checkpoint), or exactly `files` when given (paths a caller already checked), as a full
        update of `model` (a subset of it when `partial`; verified against `checksums` after
        applying, when given). Names the
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
        update = cls(version, tensors, partial=partial, checksums=checksums)
        update.check(model)
        return update

    def check(self, model: nn.Module) -> None:
        """Raise `WeightSyncError` naming the unexpected, missing (full updates only),
        mis-shaped and mis-typed tensors, if any."""
        self.stage(model)

    def stage(self, model: nn.Module) -> StagedUpdate:
        """The update checked against `model` (see `check`) and its writes: one in-place
        `copy_` per tensor, in the model's order as load_state_dict (of tied names given
        different values, the last wins), tied names sharing a source and a target once."""
        own = model.state_dict()
        problems = []
        unexpected = sorted(set(self.tensors) - set(own))
        if unexpected:
            problems.append(f"tensors the model lacks: {_names(unexpected)}")
        missing = [] if self.partial else sorted(set(own) - set(self.tensors))
        if missing:
            problems.append(f"missing tensors (a full update must cover the model; pass "
                            f"partial=True for a subset): {_names(missing)}")
        given = {k: v for k, v in self.tensors.items() if k in own}
        odd = sorted(k for k, v in given.items() if not isinstance(v, torch.Tensor))
        if odd:
            problems.append(f"not tensors: {_names(odd)}")
        given = {k: v for k, v in given.items() if k not in odd}
        shapes = [f"{k} {tuple(v.shape)} vs the model's {tuple(own[k].shape)}"
                  for k, v in given.items() if v.shape != own[k].shape]
        if shapes:
            problems.append(f"shape mismatch: {_names(shapes)}")
        dtypes = [f"{k} {v.dtype} vs the model's {own[k].dtype}"
                  for k, v in given.items() if not castable(v.dtype, own[k].dtype)]
        if dtypes:
            problems.append(f"dtype mismatch (only floating point is cast): {_names(dtypes)}")
        if problems:
            raise WeightSyncError(f"weight update v{self.version} does not fit the model: "
                                  + "; ".join(problems))
        writes: list[Write] = []
        done: set[tuple[int, int]] = set()
        for name, target in own.items():
            if name in given and (target.data_ptr(), given[name].data_ptr()) not in done:
                done.add((target.data_ptr(), given[name].data_ptr()))
                writes.append(Write(target, given[name]))
        return StagedUpdate(self.version, own, writes, self.checksums)

    def apply_to(self, model: nn.Module) -> None:
        """Stage, verify and write (`StagedUpdate.apply`): all of it or, raising, none."""
        self.stage(model).apply()


def castable(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether a tensor of `source` may be written into one of `target`: the same dtype, or
    floating point into floating point (rounded to the target's precision)."""
    return source == target or (source.is_floating_point and target.is_floating_point)


def _names(items: list[str], shown: int = 5) -> str:
    more = f" (and {len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def empty_version_folder(folder: Path, version: int, *, ours: bool) -> int:
    """Remove what the version folder `folder` holds, so a push writes the version from
    nothing: a delta's or per-rank parts' `*.safetensors` left beside a full update (the folder
    of a killed run, whose resumed run pushes the checkpoint's version again) would be read as
    tensors of it. Files there that the pusher did not write (`ours` False) are logged. The
    number of entries that could not be removed (`files.remove_tree`, each logged)."""
    left = sorted(p.name for p in folder.iterdir())
    if not left:
        return 0
    if not ours:
        logger.warning("weight push v%d: %s holds files this engine did not write (%s: a "
                       "killed run's?); removed before the version is written", version, folder,
                       ", ".join(left))
    return remove_tree(folder)
