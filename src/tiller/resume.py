"""Resuming a run (`tiller train --resume RUN_DIR`, docs/resume.md): the checks a resume
passes before it touches the run folder, the folder cut back to the checkpoint, and the RL
run's parts (`controller`'s learner, the rollout manager, the step recorder) written into and
read back from a checkpoint (`tiller.checkpoints`: the format, its atomic write and its
verification).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from pydantic import ValidationError

from tiller.algorithms.kl import kl_beta_at
from tiller.checkpoints import (
    ADAPTER_DIR,
    REFERENCE_ADAPTER,
    Checkpoint,
    checkpoint_dir,
    load_tensors,
    model_fingerprint,
    newest_checkpoint,
    write_checkpoint,
)
from tiller.config import Config
from tiller.config.base import TAGS
from tiller.config.root import first_error
from tiller.errors import ConfigError
from tiller.files import (
    folder_below,
    open_append,
    refuse_links,
    refuse_sqlite_links,
    remove_tree,
)
from tiller.models import resolve_model_path
from tiller.observe.steps import check_recorder_state
from tiller.plugins import load_env_class
from tiller.preflight import rl_task_reserve, rl_train_tasks
from tiller.rollout.curriculum import DRAW, Curriculum, make_curriculum
from tiller.rollout.resume import check_drawn, check_state, manager_state
from tiller.train.distributed import Leading
from tiller.train.process_state import (
    add_rank_states,
    check_rng_state,
    rank_states,
    rng_state,
    set_rng_state,
)

if TYPE_CHECKING:
    from tiller.observe.steps import StepRecorder
    from tiller.rollout.manager import RolloutManager

log = logging.getLogger(__name__)

def start_resume(cfg: Config, run_dir: Path) -> tuple[Checkpoint, list[str]]:
    """`tiller train --resume RUN_DIR`, before any work: the newest complete checkpoint,
    verified, every check of `check_resume` passed, and the safe config changes it allowed
    (each "field: old -> new"; `say_resumed` logs them once the run started). The run folder is
    not touched: `run.Run` cuts it back (`cut_run_dir`) once its own checks passed too."""
    ckpt = newest_checkpoint(run_dir)
    return ckpt, check_resume(cfg, ckpt, Path(run_dir))


def say_resumed(ckpt: Checkpoint, changes: list[str], run_dir: Path) -> None:
    """The resume and each safe config change, logged as warnings once the resumed run passed
    every check and started (a refused resume says only its one line), before its first RL
    step: a user's terminal shows them (`tiller train` installs no log handler, and logging's
    last resort prints WARNING and up)."""
    log.warning("--resume: from checkpoint %s (RL step %d) of %s", ckpt.path.name, ckpt.step,
                run_dir)
    for change in changes:
        log.warning("--resume: config changed (safe): %s", change)


def cut_run_dir(run_dir: Path, ckpt: Checkpoint) -> None:
    """`prepare_run_dir`, logged: called by `run.Run` after every check of a resume passed
    (`start_resume`'s, the run's preflight, the tool stack's and the model's), just before
    the run opens its sinks (metrics.jsonl, traces.sqlite)."""
    done = prepare_run_dir(run_dir, ckpt)
    log.info("--resume: from %s (RL step %d, weight version %d); %s", ckpt.path, ckpt.step,
             ckpt.state["trainer_version"], done)


def check_resume(cfg: Config, ckpt: Checkpoint, run_dir: Path) -> list[str]:
    """Every reason `cfg` cannot go on from `ckpt`, each one line (`ConfigError`), before the
    run folder is touched: a state.json of another shape (`check_state_shape`: past it, an
    error reading the state is tiller's own and raised as it is, never called the
    checkpoint's), checkpoint.every 0, a config change that breaks the run
    (`check_config`), rl.steps below the checkpoint's step or a task stream that no longer
    holds the tasks it drew (`check_stream`), trainer parts the config does not fit
    (`check_tensors`), a metrics.jsonl shorter than at the checkpoint, or a symbolic link
    in the run folder (`check_no_links`). The safe config changes."""
    check_state_shape(ckpt)
    if not cfg.checkpoint.every:
        raise ConfigError("--resume: config field checkpoint.every is 0; resume with the "
                          "run's config (its checkpoint.every)")
    check_known_fields(ckpt)
    changes = check_config(ckpt.state["config"], cfg.model_dump(mode="json"))
    if cfg.rl.steps < ckpt.step:
        raise ConfigError(f"--resume: config field rl.steps is {cfg.rl.steps}, below the "
                          f"{ckpt.step} steps checkpoint {ckpt.path.name} has trained; "
                          f"resume with rl.steps >= {ckpt.step}")
    check_base(cfg, ckpt)
    check_stream(cfg, ckpt)
    check_tensors(cfg, ckpt, ckpt.state["tensors"])
    check_no_links(run_dir)
    check_metrics_cut(run_dir / "metrics.jsonl", ckpt)
    return changes


# the most of metrics.jsonl past a checkpoint a resume moves to metrics.discarded.jsonl (it
# reads them whole): thousands of steps' rows; more is a folder that is not a run's
MAX_TAIL_BYTES = 64 << 20


def check_metrics_cut(metrics: Path, ckpt: Checkpoint) -> None:
    """One line unless metrics.jsonl can be cut back to the checkpoint's length: not shorter
    than it, the cut at a row's end, at most `MAX_TAIL_BYTES` past it."""
    length = ckpt.state["metrics_bytes"]
    size = metrics.stat().st_size if metrics.is_file() else 0
    if size < length:
        raise ConfigError(f"--resume: {metrics} is shorter ({size} bytes) than when "
                          f"checkpoint {ckpt.path.name} was written ({length} bytes)")
    if size - length > MAX_TAIL_BYTES:
        raise ConfigError(f"--resume: {metrics} holds {size - length} bytes past checkpoint "
                          f"{ckpt.path.name}, more than a resume moves to "
                          f"metrics.discarded.jsonl ({MAX_TAIL_BYTES} at most, read whole): "
                          f"move the rows past byte {length} away by hand, then resume")
    if length:
        with metrics.open("rb") as f:
            f.seek(length - 1)
            if f.read(1) != b"\n":
                raise ConfigError(f"--resume: checkpoint {ckpt.path.name}'s length of {metrics} "
                                  f"({length} bytes) ends inside a row: the checkpoint is not "
                                  f"this metrics.jsonl's")


# state.json's fields (`save_rl`) and the JSON types a resume reads them as
STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int, "trainer_version": int, "rng": dict, "holds": list, "tensors": list,
    "manager": dict, "curriculum": (dict, type(None)), "recorder": dict, "idle_steps": int,
    "metrics_bytes": int, "summary": dict, "config": dict, "base": (str, type(None))}


def check_state_shape(ckpt: Checkpoint) -> None:
    """`ckpt`'s state.json of the shape a resume reads (its hashes say the checkpoint is
    whole, not that a hand-edited one is tiller's), before any of it is used: each field of
    its JSON type (`STATE_TYPES`) and no other field (a field this tiller does not write:
    state.json's fields are pinned to the format, `FORMAT_VERSION`), metrics_bytes not
    negative (the cut of metrics.jsonl keeps that many bytes), trainer.pt's parts a list of
    names, the RNG states (each trainer rank's) put into throwaway generators
    (`check_rng_state`), the step recorder's counters of their types
    (`check_recorder_state`); the manager's and the curriculum's state are
    `check_stream`'s. One line naming the first field that is not."""
    state = ckpt.state
    try:
        for key, kind in STATE_TYPES.items():
            if not isinstance(state[key], kind) or (kind is int and type(state[key]) is bool):
                raise TypeError(f"{key} is a {type(state[key]).__name__}")
        if other := sorted(set(state) - set(STATE_TYPES)):
            raise ValueError(f"{other[0]} is not a field this tiller writes")
        if state["metrics_bytes"] < 0:
            raise ValueError(f"metrics_bytes is {state['metrics_bytes']}, below 0")
        if not all(isinstance(name, str) for name in state["tensors"]):
            raise TypeError("tensors is not a list of names")
        ranks = state["rng"].get("ranks", [])
        if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
            raise TypeError("rng's ranks is not a list of objects")
        for py in [state["rng"], *ranks]:
            check_rng_state(py)
        check_recorder_state(state["recorder"])
    # of the checks and the throwaway generators above only (what they raise for data of
    # another shape: a list too short, a number out of a C type's range)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as e:
        raise ConfigError(f"checkpoint {ckpt.path} is corrupt: its state.json does not fit "
                          f"({type(e).__name__}: {e}); move it away to resume from an older "
                          f"one") from e


def check_known_fields(ckpt: Checkpoint) -> None:
    """The checkpoint's config must be one this tiller reads: a field it does not know is
    one line naming it (the checkpoint comes from a newer tiller), as is any other way its
    config fails this tiller's validation."""
    where = f"--resume: the config of checkpoint {ckpt.path.name}"
    unknown = unknown_fields(ckpt.state["config"])
    if unknown:
        raise ConfigError(f"{where} has field {unknown[0]}, which this tiller does not know: "
                          f"the checkpoint comes from a newer tiller (it says "
                          f"{ckpt.marker.get('tiller')}); resume it with that tiller")
    try:
        Config.model_validate(ckpt.state["config"])
    except ValidationError as e:
        raise ConfigError(f"{where} is not one this tiller reads: {first_error(e)}") from e
    except ConfigError as e:  # a key of another variant of a section
        raise ConfigError(f"{where} is not one this tiller reads: {e}") from e


def check_run_config_fields(path: Path) -> None:
    """A run folder's config.yaml (what `--resume` reads) with a field this tiller does not
    know: one line naming it, the run comes from a newer tiller (any other error in the
    file is `load_config`'s to report)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return
    unknown = unknown_fields(data)
    if unknown:
        raise ConfigError(f"--resume: {path} has field {unknown[0]}, which this tiller does "
                          f"not know: the run comes from a newer tiller; resume it with that "
                          f"tiller")


def unknown_fields(data: Any) -> list[str]:
    """The fields of config `data` (as YAML gives it) this tiller's `Config` does not have,
    dotted, in the order validation meets them."""
    try:
        Config.model_validate(data)
    except ValidationError as e:
        return [".".join(str(p) for p in err["loc"] if p not in TAGS) for err in e.errors()
                if err["type"] == "extra_forbidden"]
    except ConfigError:  # a key of another variant: known to this tiller
        return []
    return []


def check_base(cfg: Config, ckpt: Checkpoint) -> None:
    """The model at model.path must be the one the checkpoint's run loaded (its
    `model_fingerprint`): the checkpoint holds no tokenizer the run reads, and under
    model.lora no base weights, so another model there would be trained on silently. One
    line naming model.path when it is not. (A built model, model.build, is made again from
    the config, which `check_config` compared.)"""
    if cfg.model.path is None:
        return
    got = model_fingerprint(resolve_model_path(cfg.model.path))
    if got != ckpt.state["base"]:
        raise ConfigError(f"--resume: the model at config field model.path "
                          f"({cfg.model.path}) is not the one checkpoint {ckpt.path.name} was "
                          f"trained from: its config, tokenizer or weights changed "
                          f"(fingerprint {got[:12]}, checkpoint's {str(ckpt.state['base'])[:12]}); "
                          f"put the run's base model back there")


def check_stream(cfg: Config, ckpt: Checkpoint) -> None:
    """The resumed run's train task stream (`preflight.rl_train_tasks`, of the resumed
    config: rl.steps sets its length) must hold the tasks the checkpoint drew, as its first
    ones: one line naming rl.steps when it is shorter, or the env when its first tasks
    changed (an env whose make_tasks gives other first tasks for another count). With
    rl.curriculum the stream is the curriculum: one built for the resumed config must take
    the checkpoint's state (`load_curriculum`: the tasks it drew per level, or its pool's)."""
    state = ckpt.state["manager"]
    check_state(state, f"checkpoint {ckpt.path}")
    reserve = rl_task_reserve(cfg)
    if reserve < state["pulled"]:
        raise ConfigError(f"--resume: config field rl.steps is {cfg.rl.steps}: its task "
                          f"stream ({reserve} tasks) is shorter than the {state['pulled']} "
                          f"checkpoint {ckpt.path.name} drew; resume with the run's rl.steps "
                          f"or more")
    env_cls = load_env_class(cfg.env.name)
    curriculum = make_curriculum(cfg, env_cls, reserve)
    if curriculum is not None:
        load_curriculum(curriculum, ckpt)
        return
    ids = [t.id for t in itertools.islice(rl_train_tasks(cfg, env_cls), state["pulled"])]
    check_drawn(ids, state, f"--resume: checkpoint {ckpt.path.name}")


def check_tensors(cfg: Config, ckpt: Checkpoint, names: list[str]) -> None:
    """The trainer's parts checkpoint `ckpt` holds (`names`: trainer.pt's, `learner_tensors`)
    must be those the config's learner has: the critic's with rl.algorithm.critic, the
    reference model's while the KL term is on (a checkpoint written once kl.off_after switched
    it off has none, and the resumed run needs none): a copy in trainer.pt, or under
    model.lora the reference adapter (`REFERENCE_ADAPTER`, listed and hashed in its
    marker), never a copy of the base."""
    kl, critic, step = cfg.rl.algorithm.kl, cfg.rl.algorithm.critic is not None, ckpt.step
    lora = cfg.model.lora is not None
    built = kl_beta_at(0, kl.beta, kl.off_after) != 0  # the learner builds a reference
    needed = kl_beta_at(step, kl.beta, kl.off_after) != 0
    has_ref = REFERENCE_ADAPTER in ckpt.marker["files"] if lora else "ref" in names
    has_critic = "critic" in names
    lacks = [k for k in ("optimizer", *(["critic_optimizer"] if has_critic else []))
             if k not in names]
    if lacks:
        raise ConfigError(f"checkpoint {ckpt.path} is corrupt: its trainer.pt holds no "
                          f"{' and no '.join(lacks)} ({', '.join(names)}); move it away to "
                          f"resume from an older one")
    if ((needed and not has_ref) or (has_ref and not built) or has_critic != critic
            or (lora and "ref" in names)):
        ref = "needed" if needed else "not needed"
        what = "reference adapter" if lora else "reference model"
        raise ConfigError(f"checkpoint {ckpt.path} holds {', '.join(names)}"
                          f"{' and ' + REFERENCE_ADAPTER if lora and has_ref else ''}: it does "
                          f"not fit the config's learner ({what} {ref} at step {step}, critic "
                          f"{'on' if critic else 'off'})")


# the files a resume writes in place (cut, appended to): one name each
IN_PLACE = ("metrics.jsonl", "metrics.discarded.jsonl", "traces.sqlite",
            "traces.sqlite-journal", "traces.sqlite-wal")


def check_no_links(run_dir: Path) -> None:
    """One line for the first symbolic link, or entry that is neither a folder nor a regular
    file (a FIFO would block the resume's open), in the run folder, or a file the resume
    writes in place (`IN_PLACE`) with another name (a hard link: its cut would cut the
    other name's file too). A resume rewrites and deletes in the folder: nothing may be
    reached through a link. W&B's own folder is not looked into (W&B keeps a `latest-run`
    link there; `MetricsLogger` refuses the folder itself as a link)."""
    for top, dirs, files in os.walk(run_dir):
        for name in [*dirs, *files]:
            path = Path(top) / name
            refuse_links(path)
            st = path.lstat()
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                raise ConfigError(f"--resume: {path} is neither a folder nor a regular file; "
                                  f"a run folder holds only those: remove it")
            if Path(top) == Path(run_dir) and name in IN_PLACE and st.st_nlink > 1:
                raise ConfigError(f"--resume: {path} has {st.st_nlink} names (a hard link); "
                                  f"a resume cuts it in place: copy it to one of its own")
        if Path(top) == Path(run_dir):
            dirs[:] = [d for d in dirs if d != "wandb"]


def load_curriculum(curriculum: Curriculum, ckpt: Checkpoint) -> None:
    """The checkpoint's curriculum state into `curriculum` (built for the resumed run); one
    line when it does not fit (`Curriculum.load_state`)."""
    where = f"--resume: checkpoint {ckpt.path.name}"
    try:
        curriculum.load_state(ckpt.state["curriculum"], where)
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"{where}: its curriculum state does not fit the config's "
                          f"rl.curriculum ({type(e).__name__}: {e})") from e


def save_rl(run: Any, learner: Any, rollouts: RolloutManager, record: StepRecorder,
            step: int, summary: dict[str, Any], idle_steps: int,
            curriculum: Curriculum | None) -> Path:
    """Checkpoint `step` of an RL run (see the module's docstring for what it holds): `run`
    is the `run.Run`, `learner` the `controller.Learner` (this module sits below both),
    `idle_steps` the steps in a row with nothing trained (`controller.IdleSteps`),
    `curriculum` rl.curriculum's (None when it is off)."""

    def parts(new: Path) -> dict[str, Any]:
        run.full_weights()
        run.model.save_pretrained(new / "model", safe_serialization=True,
                                  max_shard_size="1000GB")
        run.tokenizer.save_pretrained(new / "model")
        if run.lora is not None:  # and the reference adapter while there is one
            run.lora.save(new / ADAPTER_DIR)
        # train.world_size > 1: trainer.pt's parts and every rank's RNG states, gathered here
        ranks = (learner.trainer.checkpoint_state() if isinstance(learner.trainer, Leading)
                 else None)
        saved = learner_tensors(learner) if ranks is None else ranks[0]
        torch.save(saved, new / "trainer.pt")
        py, tensors = rng_state()
        rng = (f"rng ({', '.join(['python', 'numpy', *tensors])})"
               + (f" of each of the {len(ranks[1])} trainer ranks" if ranks else ""))
        if ranks is not None:  # rank 0's are this process's
            add_rank_states(py, tensors, ranks[1])
        torch.save(tensors, new / "rng.pt")
        manager = manager_state(rollouts, step)
        # the open groups' results are left out: the resumed run samples them again
        drawing = (None if curriculum is None else curriculum.state(
            frozenset(t["metadata"][DRAW] for t in manager["open_tasks"])))
        adapters = ([] if run.lora is None else [ADAPTER_DIR] if not run.lora.has_reference()
                    else [ADAPTER_DIR, f"{ADAPTER_DIR}/reference"])
        holds = ["model", *adapters, *saved, rng,
                 f"task stream ({manager['pulled']} drawn, {len(manager['open_tasks'])} "
                 f"open groups)",
                 *([] if drawing is None else
                   [f"curriculum ({run.cfg.rl.curriculum.mode}, {drawing['draws']} drawn)"]),
                 "ledger", "step counters", "metrics position"]
        # the rows so far on disk before their length is: the checkpoint is fsynced, and a
        # resume after a power loss needs metrics.jsonl at least this long
        return {"step": step, "trainer_version": run.trainer.version, "rng": py, "holds": holds,
                "tensors": sorted(saved), "manager": manager, "curriculum": drawing,
                "recorder": record.state(),
                "idle_steps": idle_steps, "metrics_bytes": run.logger.synced_size(),
                "summary": summary, "config": run.cfg.model_dump(mode="json"),
                "base": run.base}

    return write_checkpoint(run.dir, step, run.cfg.checkpoint.keep, parts)


def learner_tensors(learner: Any) -> dict[str, Any]:
    """The optimizer's state, and the reference model's and critic's when they exist (with
    train.world_size > 1 the ranks' gather gives the same parts: `RankSteps.state`)."""
    out: dict[str, Any] = {"optimizer": learner.trainer.optimizer.state_dict()}
    if _own_ref(learner):
        out["ref"] = learner.ref.state_dict()
    if learner.critic is not None:
        out["critic"] = learner.critic.model.state_dict()
        out["critic_optimizer"] = learner.critic.optimizer.state_dict()
    return out


def _own_ref(learner: Any) -> bool:
    """The learner holds a reference model of its own (a copy; under LoRA the reference is
    the policy with its reference adapter, which the checkpoint's adapter/ folder holds)."""
    return learner.ref is not None and learner.ref is not learner.trainer.model


def restore_rl(ckpt: Checkpoint, learner: Any, record: StepRecorder,
               curriculum: Curriculum | None) -> int:
    """Put a checkpoint's learner, recorder, curriculum and RNG states back; the RL step it
    resumes at.
    A checkpoint written once kl.off_after switched the KL term off holds no reference
    model: the learner drops the one it built (`check_tensors` said it is not needed)."""
    saved = load_tensors(ckpt.path / "trainer.pt")
    check_tensors(learner.cfg, ckpt, sorted(saved))
    if REFERENCE_ADAPTER in ckpt.marker["files"]:  # model.lora: the frozen adapter
        learner.trainer.lora.load_reference(ckpt.path / ADAPTER_DIR)
    elif "ref" not in saved and learner.ref is not None:  # the KL term is off by now
        learner.drop_reference()  # (check_tensors)
    try:  # torch's check of a saved optimizer state against this run's parameter groups
        if isinstance(learner.trainer, Leading):  # each rank its shards and RNG states
            ranks = rank_states(ckpt.state["rng"], load_tensors(ckpt.path / "rng.pt"))
            learner.trainer.load_checkpoint_state(saved, ranks, ckpt.state["trainer_version"])
        else:
            learner.trainer.optimizer.load_state_dict(saved["optimizer"])
            if "ref" in saved:
                learner.ref.load_state_dict(saved["ref"])
            if learner.critic is not None:
                learner.critic.model.load_state_dict(saved["critic"])
                learner.critic.optimizer.load_state_dict(saved["critic_optimizer"])
    except ValueError as e:
        raise ConfigError(f"checkpoint {ckpt.path} does not fit this run: "
                          f"{type(e).__name__}: {e}") from e
    # their shapes checked before any work (`check_state_shape`, `check_stream`)
    record.load_state(ckpt.state["recorder"])
    if curriculum is not None:
        load_curriculum(curriculum, ckpt)
    set_rng_state(ckpt.state["rng"], load_tensors(ckpt.path / "rng.pt"))
    return ckpt.step


# config fields a resumed run may change: they decide how long it runs, how long it waits for
# its parts (a slower node after a preemption) and what it logs, not what it samples or trains
SAFE_CHANGES = ("rl.steps", "logging.", "checkpoint.", "output_dir", "name", "eval.",
                "runtime.", "rollout.batch_timeout_s", "rollout.shutdown_timeout_s",
                "observe.traces.close_timeout_s", "engine.startup_timeout_s",
                "engine.request_timeout_s", "train.rank_timeout_s", "weight_sync.timeout_s")


def moved(key: str, old: Any, new: Any) -> bool:
    """Whether a change of `key` from `old` to `new` moves the run's external engines or Ray
    cluster to other addresses (a lost node's replacement), which a resume allows: as many
    engine.urls as before, or cluster.address from one cluster to another (attached stays
    attached). The resume pushes the checkpoint's weights to every engine and checks parity
    before the first rollout, so the new ones hold what the old ones did."""
    if key == "engine.urls":
        return bool(old) and isinstance(old, list) and isinstance(new, list) and (
            len(new) == len(old))
    return key == "cluster.address" and old is not None and new is not None


def check_config(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The safe changes between the checkpointed run's config and the resumed one's (each
    `field: old -> new`); a change that would break the run stops in one line naming it."""
    a, b = _flatten(old), _flatten(new)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k, "<unset>") != b.get(k, "<unset>"))
    for k in changed:
        if not (k.startswith(SAFE_CHANGES) or moved(k, a.get(k), b.get(k))):
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


def prepare_run_dir(run_dir: Path, ckpt: Checkpoint) -> dict[str, int]:
    """Before a resumed run opens its sinks, once `check_resume` passed: metrics.jsonl cut
    back to the checkpoint's length (the rows after it, of steps the resumed run redoes,
    appended to metrics.discarded.jsonl), the traces of those steps deleted, and temporary
    folders of checkpoints cut short removed. What was moved or deleted, by kind. Only the
    rows past the checkpoint are read (the run's rows before them never are)."""
    run_dir = Path(run_dir)
    done = {"metrics_rows_discarded": 0, "trace_episodes_deleted": 0, "temp_removed": 0}
    metrics, length = run_dir / "metrics.jsonl", ckpt.state["metrics_bytes"]
    if metrics.is_file() and metrics.stat().st_size > length:
        with metrics.open("rb") as f:
            f.seek(length)
            tail = f.read()
        done["metrics_rows_discarded"] = tail.count(b"\n")
        _discard(run_dir / "metrics.discarded.jsonl", tail, run_dir)
        # in place, one truncate(2) (check_no_links: no link in the folder, no other name)
        fd = os.open(metrics, os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, length)
            os.fsync(fd)
        finally:
            os.close(fd)
    traces = run_dir / "traces.sqlite"
    if traces.is_file():
        done["trace_episodes_deleted"] = _cut_traces(traces, ckpt)
    for tmp in folder_below(run_dir, checkpoint_dir(run_dir)).glob(".step-*.tmp"):
        remove_tree(tmp)
        done["temp_removed"] += 1
    return done


def _discard(path: Path, tail: bytes, run_dir: Path) -> None:
    """`tail` (metrics.jsonl's rows past the checkpoint) appended to `path` and fsynced. A
    resume killed before its cut of metrics.jsonl appended this tail already, whole or its
    first rows: only the rest is appended. Only the last len(tail) bytes of `path` are read;
    rows carry their times, so another run's rows are never the same bytes."""
    size = path.stat().st_size if path.is_file() else 0
    with open_append(path, root=run_dir) as f:
        with path.open("rb") as old:
            old.seek(max(0, size - len(tail)))
            end = old.read(len(tail))
        # where this tail's first rows may start: at a row's start in `end`, or past its end
        starts = [0, *(i + 1 for i, byte in enumerate(end) if byte == 0x0A), len(end)]
        at = next(i for i in starts if tail.startswith(memoryview(end)[i:]))
        if at == len(end) and end and not end.endswith(b"\n"):
            f.buffer.write(b"\n")  # a torn last row (not this tail's) ends before this tail
        f.buffer.write(tail[len(end) - at:])
        f.flush()
        os.fsync(f.fileno())


def _cut_traces(path: Path, ckpt: Checkpoint) -> int:
    """Delete the traces a killed run wrote after checkpoint `ckpt` (its RL steps past it and
    its final evaluation) and the episodes of the groups it holds open (by tag, task and draw:
    the resumed run samples them again), so the resumed run's rows take their place and each
    group is traced once. SQLite writes in place: a link at the database (or its journal) is
    refused, never written through."""
    import sqlite3

    refuse_sqlite_links(path)
    con = sqlite3.connect(path)
    try:
        with con:
            n = _delete_episodes(con, "(phase = 'rl' AND rl_step > ?) OR phase LIKE 'eval_rl%'",
                                 (ckpt.step,))
            for tag, task_id, draw in ckpt.state["manager"]["open_groups"]:
                n += _delete_episodes(con, "phase = 'rl' AND tag = ? AND task_id = ? AND "
                                      "draw = ?", (json.dumps(tag), task_id, draw))
            con.execute("DELETE FROM steps WHERE rl_step > ?", (ckpt.step,))
    finally:
        con.close()
    return n


def _delete_episodes(con: Any, where: str, args: tuple[Any, ...]) -> int:
    """Delete the episodes matching `where` and their tool calls; how many episodes."""
    con.execute(f"DELETE FROM tool_calls WHERE episode_id IN "
                f"(SELECT id FROM episodes WHERE {where})", args)
    return con.execute(f"DELETE FROM episodes WHERE {where}", args).rowcount
