"""Resumable checkpoints: the whole state of an RL run between two steps, written atomically to
RUN_DIR/checkpoints/step-<N>, and read back by `tiller train --resume RUN_DIR` (docs/resume.md).

A checkpoint folder holds:

    model/            the policy's master weights (fp32) and tokenizer, a Hugging Face
                      checkpoint (`tiller eval` can read it); under model.lora the merged
                      weights
    adapter/          under model.lora only: the adapter as peft saves it
                      (adapter_config.json, adapter_model.safetensors), what resume loads
    trainer.pt        the optimizer's state (and the critic's model and optimizer, the
                      reference model's weights while the KL term is on), `torch.save` of
                      tensors and plain values, read back with `weights_only=True`
    rng.pt            torch's CPU (and CUDA) generator states
    state.json        the step, the weight versions, Python's and numpy's RNG states, the
                      rollout manager's state (`rollout.resume`: the task stream's position,
                      the open groups' tasks, the ledger), the step recorder's counters, the
                      byte length of metrics.jsonl, the summary so far, and the run's config
    complete.json     written last: the format version, the tiller version and each file's
                      size and SHA-256. A folder without it is not a checkpoint.

Each is written in a private temporary folder, every file and the folder fsynced, then the
folder renamed into place (`files.replacing`) and its parent fsynced: a kill during a write
leaves the previous checkpoint as it was. Nothing here runs code from a run folder: weights go
through safetensors and `torch.load(weights_only=True)`, the rest is JSON.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiller.config import Config
from tiller.errors import ConfigError
from tiller.files import folder_below, remove_tree, replacing, write_file
from tiller.rollout.resume import manager_state

if TYPE_CHECKING:
    from tiller.observe.steps import StepRecorder
    from tiller.rollout.manager import RolloutManager

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
TILLER_VERSION = importlib.metadata.version("tiller")  # the installed package's
MARKER = "complete.json"
FOLDER = re.compile(r"^step-(\d+)$")
# Test hook: when set, writing a checkpoint's files sleeps this long (seconds) just before the
# marker, so a test can kill the run while a checkpoint is half written.
PAUSE_ENV = "TILLER_TEST_CHECKPOINT_PAUSE_S"
ADAPTER_DIR = "adapter"  # model.lora: the adapter, as peft saves it, beside the merged model


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


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def write_checkpoint(run_dir: Path, step: int, keep: int,
                     write_parts: Callable[[Path], dict[str, Any]]) -> Path:
    """Write checkpoint `step` below `run_dir`: `write_parts(folder)` writes the weights and
    tensors into `folder` and returns state.json's content; then the marker, fsyncs and the
    rename. Older complete checkpoints past the newest `keep` are then removed."""
    t0 = time.perf_counter()
    out = checkpoint_dir(run_dir) / f"step-{step:06d}"
    with replacing(out, root=run_dir) as new:
        new.mkdir()
        state = write_parts(new)
        (new / "state.json").write_text(json.dumps(state))
        pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
        if pause:
            time.sleep(pause)
        files = {str(p.relative_to(new)): _describe(p) for p in sorted(new.rglob("*"))
                 if p.is_file()}
        marker = {"format": FORMAT_VERSION, "tiller": TILLER_VERSION, "step": step,
                  "time": time.time(), "files": files}
        (new / MARKER).write_text(json.dumps(marker, indent=1))
        _fsync_tree(new)
    _fsync(out.parent)
    removed = [c.path.name for c in complete_checkpoints(run_dir)[keep:]]
    for name in removed:  # renamed first: a kill while it is removed leaves no half folder
        gone = checkpoint_dir(run_dir) / f".{name}.removing.tmp"
        os.replace(checkpoint_dir(run_dir) / name, gone)
        remove_tree(gone)
    log.info("checkpoint %s written in %.2fs%s", out, time.perf_counter() - t0,
             f"; removed {', '.join(removed)}" if removed else "")
    return out


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


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The checkpoints with a marker of this format, newest first; a folder without a marker
    (a copy cut short) is skipped with a warning. A marker of another format, or a file that
    does not match its marker, stops here in one line (`ConfigError`)."""
    found = []
    folder = checkpoint_dir(run_dir)
    for path in folder.iterdir() if folder.is_dir() else ():
        m = FOLDER.match(path.name)
        if m is None or not path.is_dir():
            continue
        if not (path / MARKER).is_file():
            log.warning("checkpoint %s has no %s (it was not written whole): skipped", path,
                        MARKER)
            continue
        found.append(_read_marker(path, int(m.group(1))))
    return sorted(found, key=lambda c: c.step, reverse=True)


def _read_marker(path: Path, step: int) -> Checkpoint:
    try:
        marker = json.loads((path / MARKER).read_text())
        fmt, version = marker["format"], marker["tiller"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"checkpoint {path} is corrupt: its {MARKER} does not parse ({e}); "
                          f"move it away to resume from an older one") from e
    if fmt != FORMAT_VERSION or version != TILLER_VERSION:
        raise ConfigError(f"checkpoint {path} was written by tiller {version} (checkpoint "
                          f"format {fmt}); this is tiller {TILLER_VERSION} (format "
                          f"{FORMAT_VERSION}): resume it with the tiller that wrote it")
    return Checkpoint(path, step, {}, marker)


def verify(ckpt: Checkpoint) -> Checkpoint:
    """`ckpt` with its state.json read, once every file matches its size and SHA-256 in the
    marker; a mismatch stops here in one line (`ConfigError`)."""
    for name, want in ckpt.marker["files"].items():
        p = ckpt.path / name
        got = _describe(p) if p.is_file() else None
        if got != want:
            why = "is missing" if got is None else "does not match its size and SHA-256"
            raise ConfigError(f"checkpoint {ckpt.path} is corrupt: {name} {why} in {MARKER}; "
                              f"move it away to resume from an older one")
    state = json.loads((ckpt.path / "state.json").read_text())
    return Checkpoint(ckpt.path, ckpt.step, state, ckpt.marker)


def newest_checkpoint(run_dir: Path) -> Checkpoint:
    """The newest complete checkpoint of `run_dir`, verified; one line when there is none."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {str(run_dir)!r}: not a run folder (no config.yaml)")
    found = complete_checkpoints(run_dir)
    if not found:
        raise ConfigError(f"--resume {str(run_dir)!r}: no complete checkpoint in "
                          f"{checkpoint_dir(run_dir)} (a run writes them with "
                          f"checkpoint.every > 0)")
    return verify(found[0])


# config fields a resumed run may change: they decide how long it runs and what it logs, not
# what it samples or trains
SAFE_CHANGES = ("rl.steps", "logging.", "checkpoint.", "output_dir", "name", "eval.",
                "runtime.", "rollout.batch_timeout_s", "rollout.shutdown_timeout_s",
                "observe.traces.close_timeout_s")


def check_config(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The safe changes between the checkpointed run's config and the resumed one's (each
    `field: old -> new`); a change that would break the run stops in one line naming it."""
    a, b = _flatten(old), _flatten(new)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k, "<unset>") != b.get(k, "<unset>"))
    for k in changed:
        if not k.startswith(SAFE_CHANGES):
            raise ConfigError(f"--resume: config field {k} changed ({a.get(k, '<unset>')!r} -> "
                              f"{b.get(k, '<unset>')!r}): the resumed run would not continue "
                              f"the same run; resume with the run's config")
    return [f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in changed]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Python's and numpy's generator states (JSON) and torch's (tensors)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    py = {"python": [version, list(internal), gauss],
          "numpy": [name, keys.tolist(), pos, has_gauss, cached]}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return py, tensors


def set_rng_state(py: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = py["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = py["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda{i}"] for i in range(torch.cuda.device_count()) if f"cuda{i}" in tensors]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def load_tensors(path: Path) -> Any:
    """A `torch.save`d file of a checkpoint, read as data only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def prepare_run_dir(run_dir: Path, ckpt: Checkpoint) -> dict[str, int]:
    """Before a resumed run opens its sinks: metrics.jsonl cut back to the checkpoint's length
    (the rows after it, of steps the resumed run redoes, moved to metrics.discarded.jsonl),
    the traces of those steps deleted, and temporary folders of checkpoints cut short
    removed. What was moved or deleted, by kind."""
    run_dir = Path(run_dir)
    done = {"metrics_rows_discarded": 0, "trace_episodes_deleted": 0, "temp_removed": 0}
    metrics, length = run_dir / "metrics.jsonl", ckpt.state["metrics_bytes"]
    data = metrics.read_bytes() if metrics.is_file() else b""
    if len(data) < length:
        raise ConfigError(f"--resume: {metrics} is shorter ({len(data)} bytes) than when "
                          f"checkpoint {ckpt.path.name} was written ({length} bytes)")
    if len(data) > length:
        tail = data[length:]
        done["metrics_rows_discarded"] = tail.count(b"\n")
        old = run_dir / "metrics.discarded.jsonl"
        write_file(old, (old.read_bytes() if old.is_file() else b"") + tail, root=run_dir)
        write_file(metrics, data[:length], root=run_dir)
    traces = run_dir / "traces.sqlite"
    if traces.is_file():
        done["trace_episodes_deleted"] = _cut_traces(traces, ckpt.step)
    for tmp in folder_below(run_dir, checkpoint_dir(run_dir)).glob(".step-*.tmp"):
        remove_tree(tmp)
        done["temp_removed"] += 1
    return done


def _cut_traces(path: Path, step: int) -> int:
    """Delete the traces a killed run wrote after checkpoint `step` (its RL steps past it and
    its final evaluation), so the resumed run's rows take their place."""
    import sqlite3

    con = sqlite3.connect(path)
    try:
        with con:
            where = "(phase = 'rl' AND rl_step > ?) OR phase LIKE 'eval_rl%'"
            con.execute(f"DELETE FROM tool_calls WHERE episode_id IN "
                        f"(SELECT id FROM episodes WHERE {where})", (step,))
            n = con.execute(f"DELETE FROM episodes WHERE {where}", (step,)).rowcount
            con.execute("DELETE FROM steps WHERE rl_step > ?", (step,))
    finally:
        con.close()
    return n


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


def check_checkpointable(cfg: Config) -> None:
    """Checkpoints (checkpoint.every > 0) hold what this tiller can put back: one line, before
    any work, for a run whose state it cannot."""
    if not cfg.checkpoint.every:
        return
    why = ("rl.curriculum" if cfg.rl.curriculum.enabled else
           "train.world_size > 1" if cfg.train.world_size > 1 else
           "cluster.backend: ray" if cfg.cluster.backend == "ray" else None)
    if why is not None:
        raise ConfigError(f"config field checkpoint.every: got {cfg.checkpoint.every}; "
                          f"resumable checkpoints do not yet hold the state of {why} "
                          f"(docs/resume.md): set checkpoint.every=0")


def checkpoint_due(cfg: Config, steps_trained: int) -> bool:
    """After every checkpoint.every RL steps, and after the last."""
    every = cfg.checkpoint.every
    return bool(every) and (steps_trained % every == 0 or steps_trained == cfg.rl.steps)


def start_resume(cfg: Config, run_dir: Path) -> Checkpoint:
    """`tiller train --resume RUN_DIR`, before any work: the newest complete checkpoint,
    verified, the config checked against the checkpointed run's (the safe changes logged),
    and the run folder cut back to it (`prepare_run_dir`)."""
    ckpt = newest_checkpoint(run_dir)
    if not cfg.checkpoint.every:
        raise ConfigError("--resume: config field checkpoint.every is 0; resume with the "
                          "run's config (its checkpoint.every)")
    for change in check_config(ckpt.state["config"], cfg.model_dump(mode="json")):
        log.info("--resume: config changed (safe): %s", change)
    done = prepare_run_dir(run_dir, ckpt)
    log.info("--resume: from %s (RL step %d, weight version %d); %s", ckpt.path, ckpt.step,
             ckpt.state["trainer_version"], done)
    return ckpt


def save_rl(run: Any, learner: Any, rollouts: RolloutManager, record: StepRecorder,
            step: int, summary: dict[str, Any]) -> Path:
    """Checkpoint `step` of an RL run (see the module's docstring for what it holds): `run`
    is the `run.Run`, `learner` the `controller.Learner` (this module sits below both)."""

    def parts(new: Path) -> dict[str, Any]:
        run.model.save_pretrained(new / "model", safe_serialization=True,
                                  max_shard_size="1000GB")
        run.tokenizer.save_pretrained(new / "model")
        if run.lora is not None:
            run.lora.save(new / ADAPTER_DIR)
        saved = learner_tensors(learner)
        torch.save(saved, new / "trainer.pt")
        py, tensors = rng_state()
        torch.save(tensors, new / "rng.pt")
        manager = manager_state(rollouts, step)
        holds = ["model", *([ADAPTER_DIR] if run.lora is not None else []), *saved,
                 f"rng ({', '.join(['python', 'numpy', *tensors])})",
                 f"task stream ({manager['pulled']} drawn, {len(manager['open_tasks'])} "
                 f"open groups)", "ledger", "step counters", "metrics position"]
        return {"step": step, "trainer_version": run.trainer.version,
                "engine_version": run.engine.version, "rng": py, "holds": holds,
                "manager": manager, "recorder": record.state(),
                "metrics_bytes": run.logger.path.stat().st_size, "summary": summary,
                "config": run.cfg.model_dump(mode="json")}

    return write_checkpoint(run.dir, step, run.cfg.checkpoint.keep, parts)


def learner_tensors(learner: Any) -> dict[str, Any]:
    """The optimizer's state, and the reference model's and critic's when they exist."""
    out: dict[str, Any] = {"optimizer": learner.trainer.optimizer.state_dict()}
    if _own_ref(learner):
        out["ref"] = learner.ref.state_dict()
    if learner.critic is not None:
        out["critic"] = learner.critic.model.state_dict()
        out["critic_optimizer"] = learner.critic.optimizer.state_dict()
    return out


def _own_ref(learner: Any) -> bool:
    """The learner holds a reference model of its own (a copy; under LoRA the reference is
    the policy with its adapters off, whose base the adapter's checkpoint does not change)."""
    return learner.ref is not None and learner.ref is not learner.trainer.model


def restore_rl(ckpt: Checkpoint, learner: Any, record: StepRecorder) -> int:
    """Put a checkpoint's learner, recorder and RNG states back; the RL step it resumes at."""
    saved = load_tensors(ckpt.path / "trainer.pt")
    learner.trainer.optimizer.load_state_dict(saved["optimizer"])
    if _own_ref(learner) != ("ref" in saved):
        raise ConfigError(f"checkpoint {ckpt.path}: the reference model is "
                          f"{'missing' if _own_ref(learner) else 'unexpected'}")
    if _own_ref(learner):
        learner.ref.load_state_dict(saved["ref"])
    if learner.critic is not None:
        learner.critic.model.load_state_dict(saved["critic"])
        learner.critic.optimizer.load_state_dict(saved["critic_optimizer"])
    record.load_state(ckpt.state["recorder"])
    set_rng_state(ckpt.state["rng"], load_tensors(ckpt.path / "rng.pt"))
    return ckpt.step


def describe(run_dir: Path) -> list[dict[str, Any]]:
    """Each checkpoint folder of `run_dir`, oldest first: its step, size and what it holds,
    and whether it is complete (its marker there and of this format); files are not hashed
    here (`verify` does that on resume)."""
    rows = []
    folder = checkpoint_dir(run_dir)
    for path in sorted(folder.iterdir()) if folder.is_dir() else ():
        m = FOLDER.match(path.name)
        if m is None or not path.is_dir():
            continue
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        row = {"name": path.name, "step": int(m.group(1)), "bytes": size, "holds": []}
        try:
            ckpt = _read_marker(path, row["step"]) if (path / MARKER).is_file() else None
        except ConfigError as e:
            row["status"] = str(e)
        else:
            row["status"] = "complete" if ckpt is not None else f"incomplete (no {MARKER})"
        if (path / "state.json").is_file() and row["status"] == "complete":
            row["holds"] = json.loads((path / "state.json").read_text()).get("holds", [])
        rows.append(row)
    return rows
