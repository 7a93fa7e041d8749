"""Resumable checkpoints: the whole state of an RL run between two steps, written atomically to
RUN_DIR/checkpoints/step-<N>, and read back by `tiller train --resume RUN_DIR` (docs/resume.md).

A checkpoint folder holds:

    model/            the policy's master weights (fp32) and tokenizer, a Hugging Face
                      checkpoint (`tiller eval` can read it); under model.lora the merged
                      weights
    adapter/          under model.lora only: the adapter as peft saves it
                      (adapter_config.json, adapter_model.safetensors), what resume loads;
                      while the KL term is on, adapter/reference/ too: the reference
                      adapter, a frozen copy of the adapter at RL start (the KL reference)
    trainer.pt        the optimizer's state (and the critic's model and optimizer, the
                      reference model's weights while the KL term is on), `torch.save` of
                      tensors and plain values, read back with `weights_only=True`; with
                      train.world_size > 1 the optimizer's full state gathered from every
                      rank, keyed by parameter name (`train.distributed`)
    rng.pt            torch's CPU (and CUDA) generator states; with train.world_size > 1
                      each other rank's too ("rank<r>/torch")
    state.json        the step, the trainer's weight version, Python's and numpy's RNG states (with
                      train.world_size > 1 each other rank's too, in order, as "ranks"), the
                      rollout manager's state (`rollout.resume`: the task stream's position,
                      the open groups' tasks, the ledger), rl.curriculum's state
                      (`Curriculum.state`; null when it is off), the step recorder's counters, the
                      byte length of metrics.jsonl, the summary so far, the run's config
                      and model.path's fingerprint (`model_fingerprint`)
    complete.json     written last: the format version, the step, the tiller version that
                      wrote it (for a reader: only the format is checked) and each file's size
                      and SHA-256. A folder without it is not a checkpoint.

Each is written in a private temporary folder, every file and the folder fsynced, then the
folder renamed into place (`files.replacing`) and its parent fsynced: a kill during a write
leaves the previous checkpoint as it was. A checkpoint is never written over an existing step
folder (`check_steps_free`: a run, fresh or resumed, refuses one past its start before any
work), so that rename is always one `rename(2)` onto a free name. Nothing here runs code
from a run folder: weights go through safetensors and `torch.load(weights_only=True)`, the
rest is JSON.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from tiller.config import Config
from tiller.errors import ConfigError
from tiller.files import refuse_links, remove_tree, replacing
from tiller.train.process_state import pause

log = logging.getLogger(__name__)

# what a reader checks: a checkpoint of another format is refused (2: the idle-step count,
# the trainer's parts and the open groups' draws taken out of the draw counts; 3: the base
# model's fingerprint and async's refills owed; 4: the curriculum's state; 5: no engine
# weight version, which no resume read). A change of what state.json holds changes it:
# tests/test_checkpoints.py pins STATE_KEYS and the manager's keys to it
FORMAT_VERSION = 5
MARKER = "complete.json"
FOLDER = re.compile(r"^step-(\d+)$")
# the files every checkpoint holds (the model folder holds the tokenizer's files as well)
REQUIRED = ("model/model.safetensors", "model/config.json", "trainer.pt", "rng.pt",
            "state.json")
# and, of a run under model.lora (its state.json's config), the adapter resume loads
ADAPTER_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors")
# what state.json holds (`save_rl`); a resume reads each
STATE_KEYS = ("step", "trainer_version", "rng", "holds", "tensors", "manager", "curriculum",
              "recorder", "idle_steps", "metrics_bytes", "summary", "config", "base")
# `model_fingerprint`: each weight file is read at this many evenly spaced places (its start,
# which holds a safetensors file's header, and its end among them), this many bytes each
WEIGHT_SAMPLES, SAMPLE_BYTES = 64, 1 << 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# the most a checkpoint's complete.json or state.json may hold: a run folder is data, and a
# larger one (hand-made, or not a checkpoint's) is refused as corrupt rather than read whole
MAX_JSON_BYTES = 256 << 20
# old checkpoints checkpoint.keep left in place because their marker could not be read
# (another format, corrupt), in this process; each logged
KEEP_SKIPPED: Counter[str] = Counter()


def tiller_version() -> str:
    """The installed tiller's version, written into each marker for a reader to see (not
    checked: the format is); "unknown" when tiller runs from a source tree uninstalled."""
    try:
        return importlib.metadata.version("tiller")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


ADAPTER_DIR = "adapter"  # model.lora: the adapter, as peft saves it, beside the merged model
# model.lora with the KL term on: the reference adapter (the policy's at RL start), in peft's
# subfolder for a second adapter; a resume needs it while the KL term is on
REFERENCE_ADAPTER = f"{ADAPTER_DIR}/reference/adapter_model.safetensors"
# and its config, which loading it reads: a marker listing the one lists the other
REFERENCE_CONFIG = f"{ADAPTER_DIR}/reference/adapter_config.json"


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint found in a run folder."""

    path: Path
    step: int  # RL steps trained when it was written
    state: dict[str, Any]  # state.json
    marker: dict[str, Any]  # complete.json

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.marker["files"].values())


def model_fingerprint(folder: Path) -> str:
    """SHA-256 over a model folder (model.path, which a checkpoint under model.lora does not
    hold), file by file in name order: each file's name and size, the whole content of every
    file but weights (config.json, the tokenizer's files, the chat template), and of each
    weight file (WEIGHT_SUFFIXES) WEIGHT_SAMPLES pieces of SAMPLE_BYTES spread evenly over
    it. Another model, tokenizer or config changes it; a weight file edited in place in a few
    bytes between the samples, at the same size, does not (hashing the weights whole would
    read all of them at each checkpointed run's start and each resume: docs/resume.md)."""
    digest = hashlib.sha256()
    for p in sorted(q for q in Path(folder).rglob("*") if q.is_file()):
        size = p.stat().st_size
        digest.update(f"{p.relative_to(folder)}\0{size}\0".encode())
        with p.open("rb") as f:
            if not p.name.endswith(WEIGHT_SUFFIXES) or size <= WEIGHT_SAMPLES * SAMPLE_BYTES:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                continue
            for i in range(WEIGHT_SAMPLES):
                f.seek((size - SAMPLE_BYTES) * i // (WEIGHT_SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def write_checkpoint(run_dir: Path, step: int, keep: int,
                     write_parts: Callable[[Path], dict[str, Any]]) -> Path:
    """Write checkpoint `step` below `run_dir`: `write_parts(folder)` writes the weights and
    tensors into `folder` and returns state.json's content; then the marker, fsyncs and the
    rename. Older complete checkpoints past the newest `keep` are then removed."""
    t0 = time.perf_counter()
    out = checkpoint_dir(run_dir) / f"step-{step:06d}"
    if out.is_symlink() or out.exists():  # made while the run ran: refused at its start
        raise ConfigError(f"{out} already exists: tiller does not write a checkpoint over an "
                          f"existing folder (`check_steps_free`); move it away")
    with replacing(out, root=run_dir) as new:
        new.mkdir()
        state = write_parts(new)
        pause("files")
        (new / "state.json").write_text(json.dumps(state))
        pause("marker")
        files = {str(p.relative_to(new)): _describe(p) for p in sorted(new.rglob("*"))
                 if p.is_file()}
        marker = {"format": FORMAT_VERSION, "tiller": tiller_version(), "step": step,
                  "time": time.time(), "files": files}
        (new / MARKER).write_text(json.dumps(marker, indent=1))
        _fsync_tree(new)
        pause("rename")
    _fsync(out.parent)
    removed = [c.path.name for c in _readable_checkpoints(run_dir)[keep:]]
    for name in removed:  # renamed first: a kill while it is removed leaves no half folder
        gone = checkpoint_dir(run_dir) / f".{name}.removing.tmp"
        os.replace(checkpoint_dir(run_dir) / name, gone)
        pause("remove")
        remove_tree(gone)
    log.info("checkpoint %s written in %.2fs%s", out, time.perf_counter() - t0,
             f"; removed {', '.join(removed)}" if removed else "")
    return out


def check_steps_free(run_dir: Path, after: int, why: str) -> None:
    """One line (`ConfigError`) when `run_dir`'s checkpoints folder holds a step folder past
    step `after`, complete or not: the run writes its checkpoints under those names, and a
    checkpoint is never written over an existing folder (another run's, or a copy cut short:
    its rename into place is always one `rename(2)` onto a free name)."""
    folder = checkpoint_dir(run_dir)
    taken = sorted(p.name for p in (folder.iterdir() if folder.is_dir() else ())
                   if (m := FOLDER.match(p.name)) and int(m.group(1)) > after)
    if taken:
        raise ConfigError(f"{folder} already holds {', '.join(taken[:3])}"
                          f"{' and more' if len(taken) > 3 else ''} ({why}): tiller does not "
                          f"write a checkpoint over an existing folder; move it away")


def _describe(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        _fsync(p)
    _fsync(folder)


def _marked(run_dir: Path, warn: bool = True) -> list[tuple[Path, int]]:
    """The step folders with a marker, and their steps; a folder without one (a copy cut
    short) is skipped, with a warning when `warn`."""
    found = []
    folder = checkpoint_dir(run_dir)
    for path in folder.iterdir() if folder.is_dir() else ():
        m = FOLDER.match(path.name)
        if m is None or not path.is_dir():
            continue
        if path.is_symlink():  # never read, counted among the kept, or removed through
            log.warning("checkpoint %s is a symbolic link (to %r): skipped", path,
                        os.readlink(path))
            continue
        if not (path / MARKER).is_file():
            if warn:
                log.warning("checkpoint %s has no %s (it was not written whole): skipped",
                            path, MARKER)
            continue
        found.append((path, int(m.group(1))))
    return found


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The checkpoints with a marker of this format, newest first. A marker of another
    format, or one that does not parse, stops here in one line (`ConfigError`)."""
    found = [_read_marker(path, step) for path, step in _marked(run_dir)]
    return sorted(found, key=lambda c: c.step, reverse=True)


def _readable_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """`complete_checkpoints` for checkpoint.keep, in a running run: a folder whose marker
    cannot be read is left where it is (never removed: it is not known what it is), logged
    and counted in KEEP_SKIPPED, and the run goes on."""
    found = []
    for path, step in _marked(run_dir):
        try:
            found.append(_read_marker(path, step))
        except ConfigError as e:
            KEEP_SKIPPED["unreadable"] += 1
            log.warning("checkpoint.keep: %s left in place, not counted among the kept: %s",
                        path, e)
    return sorted(found, key=lambda c: c.step, reverse=True)


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file, parsed; a ValueError when it is over MAX_JSON_BYTES (it is
    not read then)."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path.name} is {size} bytes, over the {MAX_JSON_BYTES} a "
                         f"checkpoint's holds")
    return json.loads(path.read_text())


def _read_marker(path: Path, step: int) -> Checkpoint:
    try:
        marker = read_json(path / MARKER)
        fmt, files, marked = marker["format"], marker["files"], marker["step"]
        if not isinstance(files, dict):
            raise TypeError(f"files is a {type(files).__name__}")
        for name, f in files.items():
            if not (isinstance(f, dict) and type(f.get("size")) is int
                    and isinstance(f.get("sha256"), str)):
                raise TypeError(f"files[{name!r}] is not a size and a sha256")
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"checkpoint {path} is corrupt: its {MARKER} does not parse "
                          f"({type(e).__name__}: {e}); move it away to resume from an older "
                          f"one") from e
    if fmt != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {path} is of checkpoint format {fmt} (tiller "
                          f"{marker.get('tiller')}); this tiller reads format {FORMAT_VERSION}: "
                          f"resume it with the tiller that wrote it")
    if marked != step:
        raise ConfigError(f"checkpoint {path} is corrupt: its {MARKER} says step {marked!r}, "
                          f"its folder's name step {step}; move it away to resume from an "
                          f"older one")
    return Checkpoint(path, step, {}, marker)


def verify(ckpt: Checkpoint, keys: tuple[str, ...] = STATE_KEYS) -> Checkpoint:
    """`ckpt` with its state.json read, once the marker lists every file a checkpoint holds
    (REQUIRED, ADAPTER_FILES when state.json's config has model.lora, REFERENCE_CONFIG with
    REFERENCE_ADAPTER), each a plain file inside the folder (no link, no '..' or absolute
    name) of the size (compared first: another size is not read) and SHA-256 listed,
    state.json holds `keys` and its step is the folder's; anything else stops here in one
    line (`ConfigError`)."""
    def corrupt(why: str) -> ConfigError:
        return ConfigError(f"checkpoint {ckpt.path} is corrupt: {why}; move it away to resume "
                           f"from an older one")

    files = ckpt.marker["files"]
    for name in REQUIRED:
        if name not in files:
            raise corrupt(f"{MARKER} does not list {name}")
    for p in [ckpt.path, *ckpt.path.rglob("*")]:
        if p.is_symlink():
            raise corrupt(f"{p.relative_to(ckpt.path)} is a symbolic link")
    for name, want in files.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts:
            raise corrupt(f"{MARKER} lists {name!r}, not a name inside the checkpoint")
        p = ckpt.path / name
        # the size first: a file of another size is never read (it may be large, or sparse)
        size = p.stat().st_size if p.is_file() else None
        got = None if size is None else _describe(p) if size == want["size"] else {"size": size}
        if got != want:
            why = "is missing" if got is None else "does not match its size and SHA-256"
            raise corrupt(f"{name} {why} in {MARKER}")
    try:
        state = read_json(ckpt.path / "state.json")
        missing = [k for k in keys if k not in state]
    except (ValueError, TypeError) as e:
        raise corrupt(f"state.json does not parse ({e})") from e
    if missing:
        raise corrupt(f"state.json has no {', '.join(missing)}")
    if state["step"] != ckpt.step:
        raise corrupt(f"state.json says step {state['step']!r}, the folder's name {ckpt.step}")
    for name in ADAPTER_FILES if _lora(state) else ():
        if name not in files:
            raise corrupt(f"{MARKER} does not list {name} (the run has model.lora)")
    if REFERENCE_ADAPTER in files and REFERENCE_CONFIG not in files:
        raise corrupt(f"{MARKER} lists {REFERENCE_ADAPTER} but not {REFERENCE_CONFIG}")
    return Checkpoint(ckpt.path, ckpt.step, state, ckpt.marker)


def _lora(state: dict[str, Any]) -> bool:
    """Whether state.json's config (a dict, or None in the format's own tests) has
    model.lora."""
    config = state.get("config")
    return isinstance(config, dict) and (config.get("model") or {}).get("lora") is not None


def check_run_folder(run_dir: Path) -> None:
    """One line when `run_dir` (of `--resume`) holds no config.yaml: not a run folder."""
    if not (Path(run_dir) / "config.yaml").is_file():
        raise ConfigError(f"--resume {str(run_dir)!r}: not a run folder (no config.yaml)")


def newest_checkpoint(run_dir: Path) -> Checkpoint:
    """The newest complete checkpoint of `run_dir`, verified; one line when there is none
    (`no_checkpoint`), or when a step folder without a marker lies past it
    (`check_steps_free`)."""
    run_dir = Path(run_dir)
    check_run_folder(run_dir)
    refuse_links(checkpoint_dir(run_dir))  # before a file is read through it
    # only the newest marker is read: an older checkpoint checkpoint.keep left in place
    # (another format, a marker that does not parse) does not block the resume
    marked = sorted(_marked(run_dir, warn=False), key=lambda found: found[1], reverse=True)
    if not marked:
        raise no_checkpoint(run_dir)
    # the resumed run writes its checkpoints past it: none may be there (a folder without a
    # marker, a copy cut short), as none is written over a folder
    path, step = marked[0]
    check_steps_free(run_dir, step, f"not a complete checkpoint, past {path.name} the run "
                                    f"resumes from")
    return verify(_read_marker(path, step))


def load_tensors(path: Path) -> Any:
    """A `torch.save`d file of a checkpoint, read as data only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_weights(model: torch.nn.Module, ckpt: Checkpoint) -> None:
    """The checkpoint's policy weights into `model` (safetensors: data only). Every parameter
    must be in the file, except one tied to another that is."""
    from safetensors.torch import load_file

    loaded = load_file(ckpt.path / "model" / "model.safetensors")
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    shared = {t.data_ptr() for k, t in model.state_dict().items() if k in loaded}
    untied = [k for k in missing if model.state_dict()[k].data_ptr() not in shared]
    if untied or unexpected:
        raise ConfigError(f"checkpoint {ckpt.path} does not fit the model: missing "
                          f"{untied[:3]}, unexpected {unexpected[:3]}")


def no_checkpoint(run_dir: Path) -> ConfigError:
    """The one line of a resume of a run folder without a complete checkpoint: why (the run's
    checkpoint.every, read from its config.yaml as data: 0, or the run stopped before its first
    checkpoint) and what to do."""
    try:  # a config.yaml that does not read as a run's leaves the reason open
        path = Path(run_dir) / "config.yaml"
        data = yaml.safe_load(path.read_text()) if path.stat().st_size <= MAX_JSON_BYTES else None
        every = data["checkpoint"]["every"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        every = None
    if every == 0:
        why = "its run wrote none (checkpoint.every 0)"
    elif isinstance(every, int) and every > 0:
        why = (f"its run stopped before its first (written after RL step {every} or the last "
               "step; none during the tool gate, SFT or the evaluation after it)")
    else:
        why = "its run stopped before its first, or wrote none (checkpoint.every 0)"
    return ConfigError(f"--resume {str(run_dir)!r}: no complete checkpoint in "
                       f"{checkpoint_dir(run_dir)}: {why}; nothing to resume: start the run "
                       "again in a new folder (-o), or in this one once its files are moved "
                       "away")


def checkpoint_due(cfg: Config, steps_trained: int) -> bool:
    """After every checkpoint.every RL steps, and after the last."""
    every = cfg.checkpoint.every
    return bool(every) and (steps_trained % every == 0 or steps_trained == cfg.rl.steps)


def describe(run_dir: Path) -> list[dict[str, Any]]:
    """Each checkpoint folder of `run_dir`, oldest first: its step, size and what it holds,
    and whether it is complete (its marker there and of this format; a marker or state.json
    that does not parse is shown in its status); files are not hashed here (`verify` does
    that on resume)."""
    rows = []
    folder = checkpoint_dir(run_dir)
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        m = FOLDER.match(path.name)
        if m is None or not path.is_dir():
            continue
        if path.is_symlink():  # not read through
            rows.append({"name": path.name, "step": int(m.group(1)), "bytes": 0, "holds": [],
                         "status": f"a symbolic link (to {os.readlink(path)!r}): not read"})
            continue
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        row = {"name": path.name, "step": int(m.group(1)), "bytes": size, "holds": []}
        try:
            ckpt = _read_marker(path, row["step"]) if (path / MARKER).is_file() else None
            row["status"] = "complete" if ckpt is not None else f"incomplete (no {MARKER})"
            if ckpt is not None:
                row["holds"] = _holds(path / "state.json")
        except ConfigError as e:
            row["status"] = str(e)
        rows.append(row)
    return rows


def _holds(path: Path) -> list[str]:
    """state.json's `holds` (what the checkpoint holds, as names), for `describe`; one line
    (`ConfigError`) when state.json does not parse or holds is not a list of names."""
    try:
        holds = read_json(path)["holds"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"corrupt: state.json does not parse ({type(e).__name__}: "
                          f"{e})") from e
    if not isinstance(holds, list) or not all(isinstance(h, str) for h in holds):
        raise ConfigError(f"corrupt: state.json's holds is not a list of names "
                          f"({str(holds)[:60]!r})")
    return holds
