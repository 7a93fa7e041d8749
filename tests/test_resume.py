"""Exact resume (issue 24): a run SIGKILLed at seeded moments (while it samples or trains, while
a checkpoint is half written) and resumed with `tiller train --resume` ends with the metrics
and the bit-identical weights of a run that was never stopped (rl.mode sync, the embedded
engine); in async every task is drawn once."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import closing
from pathlib import Path

import pytest
import torch
from helpers import RL_MOVES, TINY_RUN, cli, env_below, numbers, tiny_rl
from safetensors.torch import load_file
from test_vllm_demo import VLLM

from tiller.checkpoints import MARKER, REFERENCE_ADAPTER, complete_checkpoints, verify
from tiller.config import load_config
from tiller.controller import train
from tiller.errors import ConfigError, RunError
from tiller.plugins import load_env_class
from tiller.preflight import rl_task_count
from tiller.seeds import derive_seed
from tiller.train.process_state import PAUSE_ENV

ROOT = Path(__file__).resolve().parents[1]
# a tiny calculator run: SFT, 4 RL steps (a checkpoint after each) and the final eval
RUN = [*TINY_RUN, "sft.tasks=32", "rl.steps=4", "checkpoint.every=1", "checkpoint.keep=2",
       "eval.tasks=8"]
# RUN whose RL moves the weights (the tiny policy never succeeds, so without RL_MOVES its
# advantages are all 0 and its final weights are the SFT ones): what the bit-identical tests
# run, so that weights compared equal are weights RL trained
MOVES = [*RUN, *RL_MOVES]
# one tiller process, start to end: minutes on a shared machine whose other jobs hold its
# cores (a tiny run took 2 minutes there at load 10)
TIMEOUT_S = 600


class Drained(subprocess.Popen):
    """A process whose output (stdout, stderr merged into it) a thread reads as it comes, so
    a run that prints much never blocks on a full pipe, and one reader only reads the pipe
    (review s9-i24 F12): `said()` is what it printed so far, `ended()` waits for its end."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        super().__init__(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.stdout),
                                       daemon=True)
        self.reader.start()

    def said(self) -> str:
        return "".join(self.lines)

    def ended(self, timeout_s: float, what: str = "the run") -> str:
        """Its whole output once it ended within `timeout_s`; killed, and an error naming
        `what` it waited for, when it did not."""
        try:
            self.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait(30)
            raise AssertionError(f"{what} did not end within {timeout_s} s: "
                                 f"{self.said()[-3000:]}") from None
        self.reader.join(30)
        assert not self.reader.is_alive(), f"{what}'s output still open 30 s after it ended"
        return self.said()


def tiller(*args: str, pause: str = "") -> Drained:
    """`python -m tiller ARGS` in its own process; `pause` ("PHASE:SECONDS", the test hook
    PAUSE_ENV): each checkpoint write waits that long at that phase, so a kill can land
    inside one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           PAUSE_ENV: pause}
    return Drained([sys.executable, "-m", "tiller", *args], env)


def finish(proc: Drained, timeout_s: float = TIMEOUT_S) -> str:
    out = proc.ended(timeout_s)
    assert proc.returncode == 0, out[-3000:]
    return out


def resume_logged(run: Path) -> str:
    """`tiller train --resume run` with INFO logging (`tiller train` sets none): its output."""
    code = ("import logging, runpy, sys; logging.basicConfig(level=logging.INFO); "
            f"sys.argv = ['tiller', 'train', '--resume', {str(run)!r}]; "
            "runpy.run_module('tiller', run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return finish(Drained([sys.executable, "-c", code], env))


def kill_when(proc: Drained, ready, delay_s: float, timeout_s: float = TIMEOUT_S) -> None:
    """SIGKILL `proc` `delay_s` after `ready()` first holds; the kill must land (the process
    still running then)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, "the run ended before the kill point: " + proc.ended(30)
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the run never reached the kill point: "
                                 + proc.ended(30)[-3000:])
        time.sleep(0.02)
    time.sleep(delay_s)
    assert proc.poll() is None, "the run ended before the kill: " + proc.ended(30)[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.ended(30, "the killed run")


def rl_rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(json.loads(line)["phase"] == "rl" for line in path.read_text().splitlines()
               if line.endswith("}"))


def appeared(run: Path, pattern: str):
    """Whether a file or folder matching `pattern` below run/checkpoints appeared that was
    not there when asked (not one an earlier kill left)."""
    folder = run / "checkpoints"
    old = set(folder.glob(pattern))
    return lambda: bool(set(folder.glob(pattern)) - old)


def kill_mid_checkpoint(run: Path, phase: str, rng: random.Random, *args: str,
                        ranks: bool = False) -> None:
    """Resume `run` (or start it with `args`) with each checkpoint write paused 3 s at
    `phase`, and SIGKILL it inside the pause of its first write once a checkpoint is
    complete: the newest complete checkpoint is the one before (with "remove": the new one,
    whose old one was renamed aside) and it verifies whole. With `ranks` (a run of
    train.world_size > 1) its other trainer ranks exit by themselves."""
    before = [c.step for c in complete_checkpoints(run)]
    # a checkpoint's private folder (.step-N.<random>.tmp), or an old one renamed aside
    new = appeared(run, ".step-*.removing.tmp" if phase == "remove" else ".step-*.*.tmp")
    proc = tiller("train", *(args or ("--resume", str(run))), pause=f"{phase}:3")
    others = rank_pids(proc) if ranks else []
    kill_when(proc, lambda: new() and bool(complete_checkpoints(run)), rng.uniform(0.3, 1.5))
    gone(others)
    newest = verify(complete_checkpoints(run)[0])  # resumable
    if phase == "remove":
        assert newest.step > before[0] and list((run / "checkpoints").glob(".*.removing.tmp"))
    else:
        assert newest.step == (before[0] if before else 1)
        assert list((run / "checkpoints").glob(".step-*.*.tmp"))  # the half-written one


def kill_in_train_step(run: Path, rng: random.Random) -> None:
    """Resume `run` with each RL step paused 3 s between its batch shaped and its optimizer
    step (the test hook's phase "train"), and SIGKILL it inside the first pause: the kill
    lands in a train step, the checkpoint resumed from stays the newest."""
    before = [c.step for c in complete_checkpoints(run)]
    proc = tiller("train", "--resume", str(run), pause="train:3")
    kill_when(proc, lambda: any(f"{PAUSE_ENV}: 3 s at train" in line for line in proc.lines),
              rng.uniform(0.3, 1.5))
    assert [c.step for c in complete_checkpoints(run)] == before


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "final" / "model.safetensors")


def same_trained_weights(ref: Path, run: Path) -> None:
    """`run` ended with `ref`'s final weights bit for bit, and RL moved them: they are not
    `ref`'s SFT weights (an equality of SFT weights with SFT weights would test nothing)."""
    a, b = weights(ref), weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sft = load_file(ref / "checkpoints" / "sft" / "model.safetensors")
    assert not all(torch.equal(a[k], sft[k]) for k in a), "RL left the SFT weights as they were"


# what the resumed process counts afresh: the engine's and the tool stack's own counters
FRESH = ("/calculate",)


def comparable(run: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("engine/")}
            for row in numbers(run, FRESH)]


@pytest.fixture(scope="module")
def sync_whole(tmp_path_factory) -> Path:
    """The uninterrupted run the killed ones are compared with."""
    ref = tmp_path_factory.mktemp("sync") / "ref"
    finish(tiller("train", "configs/calculator.yaml", *MOVES, "-o", str(ref)))
    return ref


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed, phases", [(24, ("files", "rename")), (5, ("marker", "remove"))])
def test_sync_run_killed_at_seeded_moments_resumes_bit_identically(sync_whole, tmp_path, seed,
                                                                   phases):
    """Four kills, each asserted to land: one at a seeded moment after step 2's row (step
    3's rollouts or train step, or checkpoint 2's write), one inside a train step (its batch
    shaped, its optimizer step not taken), then two inside checkpoint writes, at the phases
    of the test hook (the seed's two of: while the files are written, before the marker,
    before the rename, while an old checkpoint is removed)."""
    ref, run = sync_whole, tmp_path / "run"
    rng = random.Random(seed)  # where each kill lands
    proc = tiller("train", "configs/calculator.yaml", *MOVES, "-o", str(run))
    kill_when(proc, lambda: rl_rows(run) >= 2, rng.uniform(0.0, 0.3))
    kill_in_train_step(run, rng)
    for phase in phases:
        kill_mid_checkpoint(run, phase, rng)
    finish(tiller("train", "--resume", str(run)))
    same_trained_weights(ref, run)
    assert comparable(run) == comparable(ref)
    assert not list((run / "checkpoints").glob(".step-*.tmp"))  # cut-short writes removed
    assert [c.step for c in complete_checkpoints(run)] == [4, 3]  # checkpoint.keep=2
    summary = json.loads((run / "summary.json").read_text())
    ref_summary = json.loads((ref / "summary.json").read_text())
    assert summary["rl"]["ledger"] == ref_summary["rl"]["ledger"]
    assert summary["heldout_after_rl"]["success"] == ref_summary["heldout_after_rl"]["success"]
    assert ({k: v for k, v in summary["heldout_after_sft"].items() if k != "time_s"}
            == {k: v for k, v in ref_summary["heldout_after_sft"].items() if k != "time_s"})


# rl.curriculum, each mode set to move within 4 steps of the tiny run: difficulty starts at the
# top level (3) and steps down while the policy fails; filter's pool of 4 is drawn every step,
# its failed tasks skipped once (a pass reshuffled by its generator)
CURRICULUM = {
    "difficulty": ["env.difficulty=3", "rl.curriculum.enabled=true", "rl.curriculum.start=3",
                   "rl.curriculum.min_groups=2"],
    "filter": ["rl.curriculum.enabled=true", "rl.curriculum.mode=filter",
               "rl.curriculum.pool=4", "rl.curriculum.max_skips=1",
               "rl.curriculum.min_groups=1"],
}


# the same run on 2 trainer ranks (FSDP2 over gloo); a collective left waiting on a dead rank
# fails within a minute, not the default 10
RANKS = [*MOVES, "train.world_size=2", "train.rank_timeout_s=60"]


def rank_pids(proc: Drained) -> list[int]:
    """The trainer ranks `proc` spawned (`train.ranks.ProcessRank`: multiprocessing's spawn),
    once they are there: its children running `spawn_main`."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmd = (stat.parent / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            if ppid == proc.pid and b"spawn_main" in cmd:
                found.append(int(stat.parent.name))
        if found:
            return found
        assert proc.poll() is None, "the run ended before its ranks started"
        assert time.monotonic() < deadline, "the run's trainer ranks never started"
        time.sleep(0.05)


def gone(pids: list[int], timeout_s: float = 60.0) -> None:
    """Every process of `pids` exits within `timeout_s` (a rank whose rank 0 was killed, a
    server whose run was)."""
    deadline = time.monotonic() + timeout_s
    while any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in pids):
        left = [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]
        assert time.monotonic() < deadline, f"processes {left} of {pids} outlived their owner"
        time.sleep(0.1)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` now (its children, theirs, ...), from /proc."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    below, more = [], [pid]
    while more:
        more = [p for p, pp in parent.items() if pp in more]
        below += more
    return below


def _state(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}") / "status").read_text().split("State:", 1)[1].split("\n")[0]
    except (OSError, IndexError):
        return "zombie"  # gone


@pytest.fixture(scope="module")
def ranks_whole(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run the killed one is compared with."""
    ref = tmp_path_factory.mktemp("ranks") / "ref"
    finish(tiller("train", "configs/calculator.yaml", *RANKS, "-o", str(ref)))
    return ref


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode, seed, phase", [("difficulty", 11, "files"),
                                               ("filter", 12, "rename")])
def test_sync_curriculum_run_killed_at_seeded_moments_resumes_bit_identically(
        tmp_path, mode, seed, phase):
    """rl.curriculum's state (level, estimates, tasks taken; filter's generator, pass and
    skips) comes back from the checkpoint: killed at a seeded moment after step 2's row, then
    inside a checkpoint write, and resumed, the run ends as the uninterrupted one did (every
    `curriculum/*` metric included)."""
    over = [*RUN, *RL_MOVES, *CURRICULUM[mode]]
    ref, run = tmp_path / "ref", tmp_path / "run"
    finish(tiller("train", "configs/calculator.yaml", *over, "-o", str(ref)))
    rng = random.Random(seed)
    proc = tiller("train", "configs/calculator.yaml", *over, "-o", str(run))
    kill_when(proc, lambda: rl_rows(run) >= 2, rng.uniform(0.0, 0.3))
    kill_mid_checkpoint(run, phase, rng)
    resumed_from = verify(complete_checkpoints(run)[0]).state["curriculum"]
    finish(tiller("train", "--resume", str(run)))
    a, b = weights(ref), weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert comparable(run) == comparable(ref)
    rows = [r for r in comparable(ref) if r["phase"] == "rl"]
    # the curriculum had state to put back: it had moved, or skipped, by the checkpoint
    if mode == "difficulty":
        assert rows[-1]["curriculum/moves"] >= 1 and resumed_from["moves"] >= 1, rows[-1]
    else:
        assert rows[-1]["curriculum/skipped_total"] > 0 and resumed_from["skipped"] > 0
    final = verify(complete_checkpoints(run)[0]).state["curriculum"]
    assert final["draws"] == 4 * 4 and final == verify(complete_checkpoints(ref)[0]).state[
        "curriculum"]


def kill_two_rank_run(run: Path, over: list[str], rng: random.Random) -> None:
    """A 2-rank run (`over`) into `run`: rank 0 SIGKILLed at a seeded moment after step 2's row
    (its other rank exits by itself), then inside a checkpoint write while rank 1 waits in the
    gather of the ranks' state (the phases after it are a 1-rank run's)."""
    proc = tiller("train", "configs/calculator.yaml", *over, "-o", str(run))
    ranks = rank_pids(proc)
    kill_when(proc, lambda: rl_rows(run) >= 2, rng.uniform(0.0, 0.3))
    gone(ranks)
    kill_mid_checkpoint(run, "ranks", rng, ranks=True)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_two_rank_run_killed_at_seeded_moments_resumes_bit_identically(ranks_whole, tmp_path):
    """train.world_size=2, sync, embedded engine: rank 0 (the run's process) SIGKILLed at a
    seeded moment after step 2's row, then inside a checkpoint write while the ranks'
    optimizer and RNG states are gathered (its other rank exits by itself each time), then
    rank 1 SIGKILLed there (the run fails naming it, and the previous checkpoint stays
    whole), then a resume with another world size refused in one line; resumed, the run ends
    with the weights, metrics, ledger and held-out success of the 2-rank run that was never
    stopped."""
    ref, run = ranks_whole, tmp_path / "run"
    rng = random.Random(22)
    kill_two_rank_run(run, RANKS, rng)
    # rank 1 dies while rank 0 waits to join the gather (the test hook's "ranks" phase)
    before = verify(complete_checkpoints(run)[0])
    new = appeared(run, ".step-*.*.tmp")
    proc = tiller("train", "--resume", str(run), pause="ranks:3")
    (rank1,) = rank_pids(proc)
    deadline = time.monotonic() + TIMEOUT_S
    while not new():
        assert proc.poll() is None and time.monotonic() < deadline, proc.said()[-3000:]
        time.sleep(0.02)
    time.sleep(rng.uniform(0.3, 1.5))
    os.kill(rank1, signal.SIGKILL)
    out = proc.ended(TIMEOUT_S, "the run whose rank 1 was killed")
    assert proc.returncode != 0, out[-2000:]
    assert "trainer rank 1 died (exit code -9) during state" in out, out[-2000:]
    newest = verify(complete_checkpoints(run)[0])
    assert newest.step == before.step and newest.marker == before.marker
    assert not list((run / "checkpoints").glob(".step-*.tmp"))  # its write, removed
    # another world size: refused in one line naming the field, the folder left as it was
    refused(run, ["train.world_size=3"], "config field train.world_size changed (2 -> 3)")
    finish(tiller("train", "--resume", str(run)))
    same_trained_weights(ref, run)
    assert comparable(run) == comparable(ref)
    assert [c.step for c in complete_checkpoints(run)] == [4, 3]
    state = verify(complete_checkpoints(run)[0]).state
    assert len(state["rng"]["ranks"]) == 1 and "rng (python, numpy, torch) of each of the 2 " \
        "trainer ranks" in state["holds"]
    summary = json.loads((run / "summary.json").read_text())
    ref_summary = json.loads((ref / "summary.json").read_text())
    assert summary["rl"]["ledger"] == ref_summary["rl"]["ledger"]
    assert summary["heldout_after_rl"]["success"] == ref_summary["heldout_after_rl"]["success"]


# what the 2 trainer ranks hold besides the policy: the KL reference model or PPO's critic
# (each sharded like the policy), or model.lora's adapters with the reference adapter; and
# the parts of trainer.pt the checkpoint holds then, named as a single rank's. (PPO keeps its
# KL in the reward: the tiny run's episodes all fail, and without it the critic's returns
# are all 0, so it would never move from its zero head)
HELD = {
    "kl": (["rl.algorithm.kl.beta=0.05"], ["optimizer", "ref"]),
    "critic": (["rl.algorithm.preset=ppo", "rl.algorithm.advantage=gae"],
               ["critic", "critic_optimizer", "optimizer", "ref"]),
    "lora": (["model.lora.r=4", "model.lora.alpha=8", "rl.algorithm.kl.beta=0.05",
              "rl.algorithm.kl.placement=loss", "rl.algorithm.kl.estimator=k3"],
             ["optimizer"]),
}


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("held, seed", [("kl", 31), ("critic", 32), ("lora", 33)])
def test_two_rank_run_with_a_reference_critic_or_lora_killed_resumes_bit_identically(
        tmp_path, held, seed):
    """train.world_size=2 with the sharded KL reference model, the sharded critic, or
    model.lora (adapters, reference adapter and their optimizer on every rank): rank 0
    SIGKILLed at a seeded moment after step 2's row, then inside a checkpoint write while the
    ranks' states are gathered (its other rank exits by itself each time); resumed, the run
    ends with the weights, metrics and ledger of the 2-rank run never stopped (the ranks'
    reference, critic and optimizer state as they were: rebuilt from the resumed weights
    instead, the KL and the values would differ)."""
    over = [*RANKS, *HELD[held][0]]
    ref, run = tmp_path / "ref", tmp_path / "run"
    finish(tiller("train", "configs/calculator.yaml", *over, "-o", str(ref)))
    rng = random.Random(seed)
    kill_two_rank_run(run, over, rng)
    resumed_from = verify(complete_checkpoints(run)[0])
    assert resumed_from.state["tensors"] == HELD[held][1]
    assert (REFERENCE_ADAPTER in resumed_from.marker["files"]) == (held == "lora")
    finish(tiller("train", "--resume", str(run)))
    a, b = weights(ref), weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert comparable(run) == comparable(ref)
    rows = [r for r in comparable(ref) if r["phase"] == "rl"]
    key = "value_loss" if held == "critic" else "kl"
    assert len(rows) == 4 and all(r[key] != 0 for r in rows[1:]), rows
    summary = json.loads((run / "summary.json").read_text())
    ref_summary = json.loads((ref / "summary.json").read_text())
    assert summary["rl"]["ledger"] == ref_summary["rl"]["ledger"]


ASYNC = [*RUN, "rl.mode=async", "rl.steps=8"]


@pytest.fixture(scope="module")
def async_whole(tmp_path_factory) -> Path:
    """An uninterrupted async run: its held-out success's CI is what a resumed one must land
    in."""
    ref = tmp_path_factory.mktemp("async") / "ref"
    finish(tiller("train", "configs/calculator.yaml", *ASYNC, "-o", str(ref)))
    return ref


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed, kill", [(6, 1), (7, 5), (8, "marker")])
def test_async_run_killed_at_seeded_moments_draws_every_task_once(async_whole, tmp_path, seed,
                                                                  kill):
    """Issue 24's async acceptance: killed at a seeded moment after RL row `kill` (or inside
    a checkpoint write, once one is complete) and resumed, the run draws every task of its
    stream once, and its held-out success is within the uninterrupted run's 95% CI."""
    run, rng = tmp_path / "run", random.Random(seed)
    if kill == "marker":  # inside checkpoint 2's write, before its marker
        kill_mid_checkpoint(run, "marker", rng, "configs/calculator.yaml", *ASYNC, "-o",
                            str(run))
    else:
        proc = tiller("train", "configs/calculator.yaml", *ASYNC, "-o", str(run))
        kill_when(proc, lambda: rl_rows(run) >= kill, rng.uniform(0.0, 0.5))
    killed_at = verify(complete_checkpoints(run)[0]).state
    finish(tiller("train", "--resume", str(run)))
    drawn_once(run, ASYNC, "async", killed_at)
    reopened_and_trained(run, killed_at)
    got = json.loads((run / "summary.json").read_text())["heldout_after_rl"]
    ref = json.loads((async_whole / "summary.json").read_text())["heldout_after_rl"]
    print(f"seed {seed}: resumed from step {killed_at['step']} with "
          f"{len(killed_at['manager']['open_tasks'])} open groups; held-out {got['success']} "
          f"in [{ref['ci_low']}, {ref['ci_high']}] ({ref['success']})")
    assert ref["ci_low"] <= got["success"] <= ref["ci_high"], (got, ref)


def half_flat(t, *_) -> float:
    """A train reward under which about half the tasks' groups are flat (all 0), the others
    split (1 for sample 0): dynamic sampling refills the flat groups' slots."""
    return 0.0 if derive_seed(t.task_id) % 2 else float(t.sample_index == 0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_refill_owed_at_a_checkpoint_is_owed_again_on_resume(tmp_path, monkeypatch):
    """async with dynamic sampling: a checkpoint written while a refill is owed (a flat
    group's slot queued for another round, not yet started; the producer is held back, once,
    until that checkpoint is written, so the narrow window a real run hits now and then is
    hit for sure) keeps it, and the run resumed from it starts it: every step trains, every
    task is drawn once."""
    from tiller.rollout import resume as rollout_resume
    from tiller.rollout.manager import RolloutManager

    over = [*ASYNC, "rl.algorithm={preset: dapo, dynamic_sampling: {enabled: true, "
            "max_rounds: 3}}", "checkpoint.keep=20", "rollout.batch_timeout_s=30"]
    monkeypatch.setattr("tiller.controller.train_reward", half_flat)
    written, held = threading.Event(), []
    save, pump = rollout_resume.manager_state, RolloutManager._pump

    def saving(m, steps):  # the checkpoint the producer waits for
        state = save(m, steps)
        if held and not written.is_set():
            held.append(steps)
            written.set()
        return state

    def pumping(m):  # a refill owed and a batch ready: hold until the checkpoint is written
        if m._refills and len(m.buffer.ready) >= m.B and not written.is_set():
            held.append(None)
            assert written.wait(60), "no checkpoint while a refill was owed"
        pump(m)

    monkeypatch.setattr("tiller.resume.manager_state", saving)
    monkeypatch.setattr(RolloutManager, "_pump", pumping)
    run = tmp_path / "run"
    train(load_config("configs/calculator.yaml", over), run)
    at = held[-1]
    assert at is not None and at < 8, held
    for ckpt in complete_checkpoints(run):
        if ckpt.step > at:
            shutil.rmtree(ckpt.path)
    killed_at = verify(complete_checkpoints(run)[0]).state
    train(load_config(run / "config.yaml"), resume=run)
    drawn_once(run, over, "async", killed_at)
    assert killed_at["manager"]["refills"]  # kept, and started by the resumed run


def reopened_and_trained(run: Path, killed_at: dict, group_size: int = 4) -> None:
    """The checkpoint the run resumed from held groups open, and the resumed run sampled
    each again and trained it: traces.sqlite holds `group_size` RL episodes of each of their
    tasks (those traced before the kill deleted by the resume), each trained after the
    checkpoint's step."""
    ids = [t["id"] for t in killed_at["manager"]["open_tasks"]]
    assert ids, "the checkpoint resumed from held no open groups"
    with closing(sqlite3.connect(run / "traces.sqlite")) as con:
        rows = con.execute(f"SELECT task_id, trained_step FROM episodes WHERE phase = 'rl' "
                           f"AND task_id IN ({', '.join('?' * len(ids))})", ids).fetchall()
    assert Counter(task for task, _ in rows) == dict.fromkeys(ids, group_size), rows
    assert all(s is not None and s > killed_at["step"] for _, s in rows), rows


def drawn_once(run: Path, over: list[str], mode: str, killed_at: dict) -> None:
    """The resumed run drew every task of its stream once (none skipped, none repeated) and
    each group's task once under its tag (a reopened group drawn again with its first
    seeds)."""
    cfg = load_config("configs/calculator.yaml", over)
    steps = cfg.rl.steps
    last = max(complete_checkpoints(run), key=lambda c: c.step)
    state = json.loads((last.path / "state.json").read_text())["manager"]
    assert last.step == steps and killed_at["step"] < steps
    assert state["pulled"] >= killed_at["manager"]["pulled"]  # async may have drawn them all
    # the stream the run draws from (run.rl_tasks: the tasks, then async's reserve)
    env, n = load_env_class(cfg.env.name), rl_task_count(cfg)
    stream = [t.id for seed in ((3, 5) if mode == "async" else (3,))
              for t in env.make_tasks("train", n, cfg.seed + seed, cfg.env.difficulty)]
    drawn = state["draw_ids"] + [t["id"] for t in state["open_tasks"]]
    # every task up to the stream's position drawn exactly once: none skipped, none repeated
    assert sorted(drawn) == sorted(stream[: state["pulled"]])
    assert state["pulled"] >= steps * cfg.rl.tasks_per_step  # at least the steps' groups
    assert {n for _, _, n in state["draws"]} == {1}, state["draws"]
    summary = json.loads((run / "summary.json").read_text())
    assert "ledger_unaccounted" not in summary["rl"] and summary["rl"]["ledger"]["trained"]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_one_step_off_run_killed_with_open_groups_draws_every_task_once(tmp_path):
    """one_step_off: the checkpoint holds the next step's groups open; the resumed run
    samples them again first, into the units they were drawn for, with their first seeds."""
    run, over = tmp_path / "run", [*RUN, "rl.mode=one_step_off", "rl.steps=8"]
    proc = tiller("train", "configs/calculator.yaml", *over, "-o", str(run))
    kill_when(proc, lambda: rl_rows(run) >= 1, random.Random(6).uniform(0.0, 0.5))
    killed_at = verify(complete_checkpoints(run)[0]).state
    assert killed_at["manager"]["open_tasks"]  # resumed with groups still open
    finish(tiller("train", "--resume", str(run)))
    drawn_once(run, over, "one_step_off", killed_at)
    reopened_and_trained(run, killed_at)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished tiny run (2 RL steps) with a checkpoint after each."""
    run = tmp_path_factory.mktemp("resume") / "run"
    train(load_config("configs/calculator.yaml", [*MOVES, "rl.steps=2", "checkpoint.keep=5"]),
          run)
    return run


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file()}


def refused(run: Path, overrides: list[str], match: str) -> str:
    """`--resume run` with `overrides` stops in one line matching `match`, before any work:
    the run folder is left byte for byte as it was."""
    before = snapshot(run)
    code, out = cli("train", "--resume", run, *overrides)
    assert code == 2 and match in out, out
    assert len(out.strip().splitlines()) == 1, out
    with pytest.raises(ConfigError, match=re.escape(match)):
        train(load_config(run / "config.yaml", overrides), resume=run)
    assert snapshot(run) == before
    return out


@pytest.mark.slow
def test_bad_resumes_stop_in_one_line_and_lose_nothing(two_steps, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    refused(run, ["rl.group_size=2"], "config field rl.group_size changed (4 -> 2)")
    refused(run, ["seed=1"], "config field seed changed")
    refused(run, ["rl.steps=1"], "config field rl.steps is 1, below the 2 steps checkpoint "
                                 "step-000002 has trained")
    # a link in the run folder: nothing is cut or deleted through it (the database it points
    # to keeps every row)
    victim = tmp_path / "victim.sqlite"
    os.replace(run / "traces.sqlite", victim)
    (run / "traces.sqlite").symlink_to(victim)
    kept = victim.read_bytes()
    refused(run, [], f"{run / 'traces.sqlite'} is a symbolic link")
    assert victim.read_bytes() == kept
    (run / "traces.sqlite").unlink()
    os.replace(victim, run / "traces.sqlite")
    (run / "eval" / "elsewhere").symlink_to(tmp_path)
    refused(run, [], f"{run / 'eval' / 'elsewhere'} is a symbolic link")
    (run / "eval" / "elsewhere").unlink()
    newest = run / "checkpoints" / "step-000002"
    # a state.json edited by hand, its marker re-hashed: whole, but not of the shape tiller
    # writes (review-i24 F11: a traceback before)
    # (review s9-i24 F9: the open groups and metrics_bytes, which the cut of the run folder
    # reads, were used unchecked after metrics.jsonl was cut; refused() asserts every file of
    # the folder, metrics.jsonl and traces.sqlite included, is left byte for byte)
    state_bytes, marker_bytes = (newest / "state.json").read_bytes(), (newest / MARKER).read_bytes()
    for edit, match in [
        (("manager", "draws", "abc"), "its state.json's manager state does not fit "
                                      "(ValueError: not enough values to unpack"),
        (("manager", "open_groups", 5), "its state.json's manager state does not fit "
                                        "(TypeError: 'int' object is not iterable"),
        ((None, "metrics_bytes", -1), "its state.json does not fit (ValueError: "
                                      "metrics_bytes is -1, below 0"),
    ]:
        state = json.loads(state_bytes)
        section, key, value = edit
        (state[section] if section else state)[key] = value
        (newest / "state.json").write_text(json.dumps(state))
        marker = json.loads(marker_bytes)
        marker["files"]["state.json"] = {
            "size": (newest / "state.json").stat().st_size,
            "sha256": hashlib.sha256((newest / "state.json").read_bytes()).hexdigest()}
        (newest / MARKER).write_text(json.dumps(marker))
        refused(run, [], f"step-000002 is corrupt: {match}")
    (newest / "state.json").write_bytes(state_bytes)
    (newest / MARKER).write_bytes(marker_bytes)
    # a corrupt file in the newest checkpoint: named, and the checkpoint kept for a look
    data = bytearray((newest / "trainer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "trainer.pt").write_bytes(bytes(data))
    refused(run, [], "step-000002 is corrupt: trainer.pt does not match")
    # another format
    marker = json.loads((newest / MARKER).read_text())
    (newest / MARKER).write_text(json.dumps({**marker, "format": 99}))
    refused(run, [], "checkpoint format 99")
    # a partial one (no marker: never renamed into place whole) is skipped: step 1 is used,
    # but the resumed run would write its step 2 over that folder (two renames, not one: a
    # kill between them would leave no step 2 at all), so it is refused until moved away
    (newest / MARKER).unlink()
    assert [c.step for c in complete_checkpoints(run)] == [1]
    refused(run, [], f"{run / 'checkpoints'} already holds step-000002 (not a complete "
                     f"checkpoint, past step-000001 the run resumes from)")
    # a fresh run into a run's folder: it would append to its record (review s9 F4)
    before = snapshot(run)
    code, out = cli("train", "configs/calculator.yaml", *RUN, "-o", run)
    assert code == 2 and f"run folder {run} already holds a run's metrics.jsonl, " \
        "traces.sqlite, summary.json: resume that run with" in out, out
    assert snapshot(run) == before
    # or into a folder with only checkpoints: a later --resume would take the other run's,
    # and its own would be written over theirs
    other = tmp_path / "other"
    shutil.copytree(run / "checkpoints", other / "checkpoints")
    code, out = cli("train", "configs/calculator.yaml", *RUN, "-o", other)
    assert code == 2 and f"{other / 'checkpoints'} already holds step-000001, step-000002 " \
        "(another run's checkpoints: resume that run with --resume)" in out, out
    shutil.rmtree(run / "checkpoints" / "step-000001")
    shutil.rmtree(newest)
    refused(run, [], "no complete checkpoint")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = cli("train", "--resume", empty)
    assert code == 2 and "not a run folder (no config.yaml)" in out


@pytest.mark.slow
def test_one_step_off_curriculum_checkpoint_leaves_the_open_groups_results_out(tmp_path):
    """one_step_off with a difficulty curriculum: a checkpoint holding open groups keeps no
    estimate of their draws (the resumed run samples them again and records them anew); the
    run resumed from it draws on from the checkpoint's draw counter, each draw number once."""
    over = [*RUN, "rl.mode=one_step_off", "checkpoint.keep=10", *CURRICULUM["difficulty"]]
    whole = tmp_path / "whole"
    train(load_config("configs/calculator.yaml", over), whole)
    ckpt = verify(min(complete_checkpoints(whole), key=lambda c: c.step))
    opened = [t["metadata"]["curriculum_draw"] for t in ckpt.state["manager"]["open_tasks"]]
    state = ckpt.state["curriculum"]
    kept = [d for _, results in state["estimates"] for d, _ in results]
    assert opened and state["draws"] == ckpt.state["manager"]["pulled"] == 4 + len(opened)
    assert sorted(kept) == list(range(4)) and not set(kept) & set(opened)
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    for c in complete_checkpoints(run):
        if c.step > ckpt.step:
            shutil.rmtree(c.path)
    summary = train(load_config(run / "config.yaml"), resume=run)
    assert summary["resumed_from"] == "step-000001"
    end = verify(complete_checkpoints(run)[0]).state
    assert end["curriculum"]["draws"] == end["manager"]["pulled"]  # no draw number twice
    assert [r["phase_step"] for r in rl_rows_of(run)] == [1, 2, 3, 4]
    assert "ledger_unaccounted" not in summary["rl"]


def rl_rows_of(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["phase"] == "rl"]


@pytest.fixture(scope="module")
def curriculum_steps(tmp_path_factory):
    """A finished tiny run (2 RL steps) under a difficulty curriculum, a checkpoint after
    each."""
    run = tmp_path_factory.mktemp("curriculum") / "run"
    train(load_config("configs/calculator.yaml", [*MOVES, "rl.steps=2", "checkpoint.keep=5",
                                                  *CURRICULUM["difficulty"]]), run)
    return run


@pytest.mark.slow
def test_a_curriculum_change_on_resume_is_refused_in_one_line(curriculum_steps, tmp_path):
    """The curriculum's config decides what its saved state means: a change to it is refused
    in one line naming the field, before any work, the folder left as it was."""
    run = tmp_path / "run"
    shutil.copytree(curriculum_steps, run)
    state = verify(complete_checkpoints(run)[0]).state["curriculum"]
    assert state["draws"] == 8 and [level for level, _ in state["taken"]][0] == 3
    refused(run, ["rl.curriculum.window=4"], "config field rl.curriculum.window changed "
                                             "(8 -> 4)")
    refused(run, ["rl.curriculum.band=[0.2, 0.8]"], "config field rl.curriculum.band changed")
    refused(run, ["rl.curriculum.enabled=false"], "config field rl.curriculum.enabled "
                                                  "changed (True -> False)")


@pytest.mark.slow
def test_more_steps_on_resume_continue_the_same_curriculum(curriculum_steps, tmp_path):
    """rl.steps raised on resume: each level's tasks are made again for the larger count
    (the calculator's first tasks do not change with it), and the finished 2-step curriculum
    run, resumed with rl.steps=3, ends as a 3-step curriculum run does."""
    whole = tmp_path / "whole"
    train(load_config("configs/calculator.yaml", [*MOVES, "rl.steps=3",
                                                  *CURRICULUM["difficulty"]]), whole)
    run = tmp_path / "run"
    shutil.copytree(curriculum_steps, run)
    train(load_config(run / "config.yaml", ["rl.steps=3"]), resume=run)
    same_trained_weights(whole, run)
    rl = [[r for r in comparable(d) if r["phase"] == "rl"] for d in (whole, run)]
    assert rl[0] == rl[1] and len(rl[0]) == 3
    assert [r["curriculum/difficulty"] for r in rl[0]] == [3, 2, 1]  # it moved each step


@pytest.mark.slow
def test_resume_refused_by_the_runs_preflight_leaves_the_folder_as_it_was(two_steps, tmp_path):
    """A safe change (eval.*) that the run's own preflight (`preflight.check_run`) refuses:
    refused in one line before the run folder is cut back to the checkpoint (the finished
    run's rows and traces after checkpoint 2, of its final evaluation, are all still there,
    every file byte for byte)."""
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    assert trace_counts(run)[-1] and any(r[0] == "eval_rl" for r in trace_counts(run))
    refused(run, ["eval.sets=[{name: odd, split: nope}]"],
            "config field eval.sets (odd).split: got 'nope'")


@pytest.mark.slow
def test_a_checkpoint_of_a_newer_tillers_config_is_refused_naming_the_field(two_steps,
                                                                           tmp_path):
    """The checkpoint's config (then the run's config.yaml as well) has a field this tiller
    does not know (a newer tiller wrote it): one line naming the field and saying so, the
    folder left as it was."""
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    newest = run / "checkpoints" / "step-000002"
    state = json.loads((newest / "state.json").read_text())
    state["config"]["rl"]["new_knob"] = 1
    (newest / "state.json").write_text(json.dumps(state))
    marker = json.loads((newest / MARKER).read_text())
    digest = hashlib.sha256((newest / "state.json").read_bytes()).hexdigest()
    marker["files"]["state.json"] = {"size": (newest / "state.json").stat().st_size,
                                     "sha256": digest}
    (newest / MARKER).write_text(json.dumps(marker))
    refused(run, [], "the config of checkpoint step-000002 has field rl.new_knob, which this "
                     "tiller does not know: the checkpoint comes from a newer tiller")
    # the run's config.yaml too (what --resume reads first): said of the run, in one line
    config = (run / "config.yaml").read_text()
    assert "\nrl:\n" in config
    (run / "config.yaml").write_text(config.replace("\nrl:\n", "\nrl:\n  new_knob: 1\n", 1))
    before = snapshot(run)
    code, out = cli("train", "--resume", run)
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert (f"{run / 'config.yaml'} has field rl.new_knob, which this tiller does not know: "
            f"the run comes from a newer tiller") in out, out
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_reopened_groups_episodes_are_traced_once_after_resume(tmp_path):
    """one_step_off: the groups a checkpoint holds open had episodes traced already (they
    ended before the step was taken); the resumed run samples those groups again, with the
    same seeds, and traces.sqlite holds each episode (tag, task, draw, sample) once."""
    over = [*RUN, "rl.mode=one_step_off", "rl.steps=4", "checkpoint.keep=10"]
    whole = tmp_path / "whole"
    train(load_config("configs/calculator.yaml", over), whole)

    def traced(run: Path, step: int) -> list[tuple]:
        with closing(sqlite3.connect(run / "traces.sqlite")) as con:
            return con.execute("SELECT tag, task_id, draw, sample_index FROM episodes WHERE "
                               "phase = 'rl' AND rl_step <= ?", (step,)).fetchall()

    # the first checkpoint holding open groups whose episodes were traced by then
    steps = [c.step for c in sorted(complete_checkpoints(whole), key=lambda c: c.step)
             if c.step < 4 and {t["id"] for t in verify(c).state["manager"]["open_tasks"]}
             & {r[1] for r in traced(whole, c.step)}]
    assert steps, "no checkpoint with open groups already traced"
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    for ckpt in complete_checkpoints(run):
        if ckpt.step > steps[0]:
            shutil.rmtree(ckpt.path)
    train(load_config(run / "config.yaml"), resume=run)
    rows = traced(run, 4)
    assert len(rows) == len(set(rows)), sorted(r for r in rows if rows.count(r) > 1)[:4]
    groups = Counter(r[:3] for r in rows)  # each of group_size 4 episodes, traced once
    assert set(groups.values()) == {4} and len(groups) == 4 * 4, groups


@pytest.mark.slow
def test_safe_change_resumes_and_checkpoints_are_listed(two_steps, tmp_path):
    """`tiller train --resume` with safe config changes: the user's terminal shows the
    checkpoint and step it resumed from and each change (review s9 F2), and summary.json
    records them."""
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    shutil.rmtree(run / "checkpoints" / "step-000002")
    code, out = cli("checkpoints", run)
    assert code == 0 and "step-000001" in out and "complete" in out, out
    assert "optimizer" in out and "0 open groups" in out  # sync: no open groups
    traced = trace_counts(two_steps)
    code, out = cli("train", "--resume", run, "logging.tensorboard=false", "eval.tasks=4")
    assert code == 0, out
    assert f"--resume: from checkpoint step-000001 (RL step 1) of {run}" in out, out
    assert "--resume: config changed (safe): eval.tasks: 8 -> 4" in out, out
    assert "--resume: config changed (safe): logging.tensorboard: True -> False" in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == "step-000001"
    assert summary["resumes"] == [{"from": "step-000001", "step": 1, "config_changes": [
        "eval.tasks: 8 -> 4", "logging.tensorboard: True -> False"]}]
    assert summary["heldout_after_rl"]["tasks"] == 4
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase_step"] for r in rows if r["phase"] == "rl"] == [1, 2]  # step 2 redone
    assert (run / "metrics.discarded.jsonl").is_file()  # the killed run's rows, kept aside
    # traces append: step 2's episodes and ledger row once (the cut-off ones deleted), the
    # evaluation after RL once, of its 4 tasks now
    got = trace_counts(run)
    assert ("eval_rl", None, 4) in got and ("eval_rl", None, 8) in traced
    assert [r for r in got if r[0] != "eval_rl"] == [r for r in traced if r[0] != "eval_rl"]


def test_restore_rl_blames_the_checkpoint_only_for_what_does_not_fit(model, tokenizer,
                                                                      tmp_path, monkeypatch):
    """Review s8 F7: `restore_rl` called any KeyError, TypeError, ValueError or
    AttributeError while it put the state back "checkpoint does not fit this run", a bug of
    tiller's own (here an attribute renamed in the recorder) included. Now only torch's
    refusal of a saved optimizer state of other parameter groups is the checkpoint's (the
    state's shape was checked before any work: `check_state_shape`); a bug is raised as
    itself."""
    from tiller.checkpoints import STATE_KEYS, write_checkpoint
    from tiller.controller import Learner
    from tiller.observe.steps import StepRecorder
    from tiller.resume import restore_rl
    from tiller.train.process_state import rng_state
    from tiller.train.trainer import PolicyTrainer

    cfg = load_config(None, ["model.build.vocab_size=600", "checkpoint.every=1"])
    learner = Learner(cfg, PolicyTrainer(model), tokenizer, None)
    record = StepRecorder(lambda *a: None, None, learner.trainer, tools=dict, engine=dict)
    record.trainer_s = 2.5

    def checkpoint(step: int, optimizer: dict) -> object:
        def parts(new: Path) -> dict:
            (new / "model").mkdir()
            for name in ("model.safetensors", "config.json"):  # not read by restore_rl
                (new / "model" / name).write_text("stand-in")
            torch.save({"optimizer": optimizer}, new / "trainer.pt")
            py, tensors = rng_state()
            torch.save(tensors, new / "rng.pt")
            return {**dict.fromkeys(STATE_KEYS), "step": step, "trainer_version": step,
                    "rng": py, "recorder": record.state(), "tensors": ["optimizer"]}

        write_checkpoint(tmp_path / "run", step, 5, parts)
        return verify(complete_checkpoints(tmp_path / "run")[0])

    fits = checkpoint(1, learner.trainer.optimizer.state_dict())
    record.trainer_s = 0.0
    assert restore_rl(fits, learner, record, None) == 1 and record.trainer_s == 2.5
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).state_dict()
    with pytest.raises(ConfigError, match=re.escape(
            f"checkpoint {tmp_path / 'run' / 'checkpoints' / 'step-000002'} does not fit this "
            f"run: ValueError: loaded state dict contains a parameter group that doesn't "
            f"match the size of optimizer's group")):
        restore_rl(checkpoint(2, other), learner, record, None)

    def renamed(self, state):
        self.trend.countz.update(state["env_errors"])  # a typo of tiller's own

    monkeypatch.setattr(StepRecorder, "load_state", renamed)
    with pytest.raises(AttributeError, match="has no attribute 'countz'"):
        restore_rl(fits, learner, record, None)


def trace_counts(run: Path) -> list[tuple]:
    with closing(sqlite3.connect(run / "traces.sqlite")) as con:
        return (con.execute("SELECT phase, rl_step, count(*) FROM episodes GROUP BY phase, "
                            "rl_step ORDER BY phase, rl_step").fetchall()
                + con.execute("SELECT rl_step, global_step FROM steps ORDER BY rl_step")
                .fetchall())


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_resume_after_the_engine_server_died_repushes_the_checkpoint(calc_sft_dir, tmp_path):
    """engine.backend http: the `tiller serve` process died and came back with its start-up
    weights (version 0); the resumed run pushes it the checkpoint's weights and version, and
    checks parity, before its first rollout, and ends as the run never stopped did. Then the
    server is lost for good and a new one answers at another port (review s9 F11): resumed
    with engine.urls moved there (a safe change, listed in summary.json), the run pushes the
    new server the checkpoint's weights and ends the same again."""
    from test_http_engine import server_version, servers

    run = tmp_path / "run"
    with servers(calc_sft_dir, 1, tmp_path / "servers") as s:
        def config(urls: list[str]):
            return load_config("configs/calculator.yaml", tiny_rl(
                calc_sft_dir, "model.dtype=float32", "rl.steps=2", "rl.tasks_per_step=4",
                *RL_MOVES, "engine.backend=http", f"engine.urls={json.dumps(urls)}",
                f"engine.weights_dir={s.root / 'weights'}", "checkpoint.every=1",
                "checkpoint.keep=5"))

        train(config(s.urls), run)
        whole = weights(run)
        rows = comparable(run)
        assert server_version(s.urls[0]) == 2
        shutil.rmtree(run / "checkpoints" / "step-000002")  # as if killed in step 2
        s.restart(0)  # the server died; it comes back holding its model folder's weights
        assert server_version(s.urls[0]) == 0
        summary = train(config(s.urls), resume=run)
        assert summary["resumed_from"] == "step-000001"
        assert server_version(s.urls[0]) == 2
        assert all(torch.equal(whole[k], v) for k, v in weights(run).items())
        assert comparable(run) == rows
        # the server's node is lost: a new server (its start-up weights) at another port, the
        # same weights folder
        s.kill(0)
        shutil.rmtree(run / "checkpoints" / "step-000002")
        with servers(calc_sft_dir, 1, s.root, name="moved") as moved:
            assert moved.urls != s.urls and server_version(moved.urls[0]) == 0
            summary = train(config(moved.urls), resume=run)
            assert server_version(moved.urls[0]) == 2
    assert summary["resumed_from"] == "step-000001"
    assert summary["resumes"][-1]["config_changes"] == [
        f"engine.urls: {s.urls!r} -> {moved.urls!r}"]
    resumed = weights(run)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    sft = load_file(calc_sft_dir / "model.safetensors")  # RL moved the weights
    assert not all(torch.equal(whole[k], sft[k]) for k in whole if k in sft)
    assert comparable(run) == rows


# the servers' start-up waited for longer: `tiller serve` imports torch, which takes minutes
# on a loaded machine
MANAGED = [*MOVES, "engine.backend=http", "engine.servers=1", "runtime.threads=1",
           "engine.startup_timeout_s=600"]
MANAGED_TIMEOUT_S = 900


def started(launch: list[str]) -> int:
    """The server process's pid, from its launch's lines (uvicorn's start-up line)."""
    return int(next(re.search(r"Started server process \[(\d+)\]", line)[1]
                    for line in launch if "Started server process" in line))


def launches(log: Path) -> list[list[str]]:
    """A managed server's log (appended to by each run that starts it), one list of lines
    per start: each begins with the `$ argv` line ManagedServers writes."""
    out: list[list[str]] = []
    for line in log.read_text().splitlines():
        if line.startswith("$ "):
            out.append([])
        out[-1].append(line)
    return out


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(4 * MANAGED_TIMEOUT_S)
def test_resume_after_the_runs_managed_server_died_with_it(tmp_path):
    """engine.servers: the run starts its own `tiller serve`. SIGKILLed at a seeded moment,
    the run takes its server (and every other process it started) with it; `--resume` starts
    a new server, pushes it the checkpoint's weights and version and checks parity before its
    first rollout, and ends with the metrics and bit-identical weights of a run that was never
    stopped."""
    ref, run, rng = tmp_path / "ref", tmp_path / "run", random.Random(25)
    finish(tiller("train", "configs/calculator.yaml", *MANAGED, "-o", str(ref)),
           MANAGED_TIMEOUT_S)
    proc = tiller("train", "configs/calculator.yaml", *MANAGED, "-o", str(run))
    below: list[int] = []

    def ready() -> bool:  # step 2 logged: its server is up; its processes noted
        if rl_rows(run) < 2:
            return False
        below.extend(descendants(proc.pid))
        return True

    kill_when(proc, ready, rng.uniform(0.0, 0.3), MANAGED_TIMEOUT_S)
    (first,) = launches(run / "servers" / "serve-0.log")
    server = started(first)
    assert server in below, (server, below)
    gone(below, timeout_s=30)  # the server (PR_SET_PDEATHSIG) died with the run
    killed_at = verify(complete_checkpoints(run)[0]).state
    assert killed_at["step"] >= 1
    finish(tiller("train", "--resume", str(run)), MANAGED_TIMEOUT_S)
    first, second = launches(run / "servers" / "serve-0.log")  # a new server
    gone([started(second)], timeout_s=30)  # stopped when the resumed run ended
    upto = next(i for i, line in enumerate(second) if '"POST /generate' in line)
    pushed = [i for i, line in enumerate(second[:upto])
              if line.endswith(f"to version {killed_at['trainer_version']}")]
    # the checkpoint's weights and version pushed, then scored (parity), before any rollout
    assert pushed and any('"POST /score' in line for line in second[pushed[0]:upto]), second
    assert not any("to version" in line for line in second[:upto]
                   if not line.endswith(f"to version {killed_at['trainer_version']}")), second
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == f"step-{killed_at['step']:06d}"
    assert comparable(run) == comparable(ref)
    same_trained_weights(ref, run)


# the demo through one managed vLLM CPU server (test_vllm_demo's model: vLLM's CPU attention
# has no head size 16), a checkpoint after each of its 2 RL steps
VLLM_RUN = [*RUN, *VLLM, *RL_MOVES, "rl.steps=2", "eval.tasks=4"]


def temp_users(temp: Path) -> list[int]:
    """This user's processes whose TMPDIR lies below `temp`: managed servers (each gets a
    TMPDIR folder of its own in the temp folder, `engine/servers.py`) and every process they
    spawned, whatever its command line."""
    return env_below("TMPDIR", temp)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_resume_of_a_vllm_run_pushes_the_checkpoint_to_its_new_server(tmp_path, monkeypatch):
    """engine.backend vllm: the run starts its own vLLM server. SIGKILLed after its first
    checkpoint, it takes the server with it, the server's engine core process included;
    `--resume` starts a new server, pushes it the checkpoint's weights and version and checks
    parity before its first rollout, draws every task once and ends with every step."""
    run, temp = tmp_path / "run", Path(tempfile.mkdtemp(prefix="tv-", dir="/tmp"))
    # the servers' TMPDIR folders (short: vLLM's socket paths) go below a folder of our own
    monkeypatch.setenv("TMPDIR", str(temp))
    try:
        proc = tiller("train", "configs/calculator.yaml", *VLLM_RUN, "-o", str(run))
        below: list[int] = []

        def ready() -> bool:  # checkpoint 1 written: the server's processes noted
            if not complete_checkpoints(run):
                return False
            below.extend(temp_users(temp))
            return True

        kill_when(proc, ready, random.Random(24).uniform(0.0, 0.3))
        # the server, its engine core and multiprocessing's resource tracker died with the run
        # (at least one process besides the server: vLLM 0.32 has 2, another vLLM may have more)
        assert started(launches(run / "servers" / "vllm-0.log")[0]) in below \
            and len(below) >= 2, below
        gone(below, timeout_s=30)
        killed_at = verify(complete_checkpoints(run)[0]).state
        assert killed_at["step"] == 1
        out = resume_logged(run)
        assert not temp_users(temp)  # the new server stopped with its run
        # what a SIGKILL leaves (docs/engines.md): the killed server's temp folder, only it
        assert len(list(temp.glob("tiller-vllm-0-*"))) == 1
    finally:
        shutil.rmtree(temp)
    first, second = launches(run / "servers" / "vllm-0.log")  # a new server
    assert started(first) != started(second)

    def logged(line: str, after: int = 0) -> int:  # where `line` is first logged after
        at = out.find(line, after)
        assert at >= 0, f"not logged: {line!r}\n{out[-4000:]}"
        return at

    # from the new server's start: its connect (a probe, the logprobs-mode check's 2 samples,
    # the parity of its start-up weights, the checkpoint's), then the push of the checkpoint's
    # weights and version and its parity check (1 request), and only then the rollouts
    v = killed_at["trainer_version"]
    at = logged(f"started server vllm-0 (pid {started(second)})")
    push = logged(f"weight sync v{v}: full, ", at)
    checked = logged(f"weight sync v{v}: parity checked on http://127.0.0.1:", push)
    completions = [m.start() for m in re.finditer(r"POST http://\S+/v1/completions", out)]
    assert [sum(at < c < push for c in completions), sum(push < c < checked
                                                         for c in completions)] == [4, 1], out
    assert "weight sync v" not in out[at:push].replace(f"weight sync v{v}:", ""), out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == "step-000001" and rl_rows(run) == 2
    drawn_once(run, VLLM_RUN, "sync", killed_at)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [
    ["rl.algorithm.preset=ppo", "rl.algorithm.advantage=gae", *RL_MOVES],
    ["rl.algorithm.kl.beta=0.05", *RL_MOVES],
    ["rl.algorithm.kl.beta=0.05", "rl.algorithm.kl.off_after=1", *RL_MOVES],
])
def test_critic_and_reference_model_resume_bit_identically(tmp_path, algorithm):
    """The critic's weights and optimizer (ppo), the reference model (kl.beta > 0) come back
    from trainer.pt: a resume from step 1 of 3 ends where the whole run did. With
    kl.off_after=1 the KL term is off from the second step on, which frees the reference
    model: checkpoint 2 holds none, and a resume from it needs none."""
    over = [*RUN, "rl.steps=3", "checkpoint.keep=5", *algorithm]
    whole = tmp_path / "whole"
    train(load_config("configs/calculator.yaml", over), whole)
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    kl_off = any("off_after" in a for a in algorithm)
    start = 2 if kl_off else 1
    for step in range(start + 1, 4):
        shutil.rmtree(run / "checkpoints" / f"step-00000{step}")
    saved = torch.load(run / "checkpoints" / f"step-00000{start}" / "trainer.pt",
                       weights_only=True)
    assert ("ref" in saved) != kl_off and ("critic" in saved) == ("ppo" in algorithm[0])
    train(load_config("configs/calculator.yaml", over), resume=run)
    same_trained_weights(whole, run)
    assert comparable(run) == comparable(whole)


@pytest.mark.slow
def test_resume_puts_back_the_rng_that_dropout_draws_from(tmp_path, monkeypatch):
    """Review s9 F3: model.lora.dropout with model.dropout=keep draws each gradient pass's
    masks from torch's global generator, so step 2's masks depend on what SFT and step 1 drew:
    a resume from step 1 of 2 ends with the whole run's weights and metrics only if the
    checkpoint's RNG state is put back; with `resume.set_rng_state` made a no-op, the same
    resume ends elsewhere."""
    over = [*MOVES, "rl.steps=2", "checkpoint.keep=5", "model.lora.r=4", "model.lora.alpha=8",
            "model.lora.dropout=0.2", "model.dropout=keep"]
    whole = tmp_path / "whole"
    train(load_config("configs/calculator.yaml", over), whole)
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    shutil.rmtree(run / "checkpoints" / "step-000002")
    again = tmp_path / "again"
    shutil.copytree(run, again)
    train(load_config("configs/calculator.yaml", over), resume=run)
    same_trained_weights(whole, run)
    assert comparable(run) == comparable(whole)
    monkeypatch.setattr("tiller.resume.set_rng_state", lambda *_: None)
    train(load_config("configs/calculator.yaml", over), resume=again)
    a, b = weights(whole), weights(again)
    assert not all(torch.equal(a[k], b[k]) for k in a), "the RNG restore decided nothing"


@pytest.mark.slow
def test_more_steps_on_resume_continue_the_same_run(two_steps, tmp_path):
    """rl.steps raised on resume (a safe change): the finished 2-step run, resumed from its
    last checkpoint with rl.steps=3, ends as a 3-step run does."""
    whole = tmp_path / "whole"
    train(load_config("configs/calculator.yaml", [*MOVES, "rl.steps=3"]), whole)
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    train(load_config(run / "config.yaml", ["rl.steps=3"]), resume=run)
    same_trained_weights(whole, run)
    rl = [[r for r in comparable(d) if r["phase"] == "rl"] for d in (whole, run)]
    assert rl[0] == rl[1] and len(rl[0]) == 3


@pytest.mark.slow
def test_idle_steps_in_a_row_carry_over_a_resume(calc_sft_dir, tmp_path):
    """rl.max_idle_steps counts flat steps in a row across a resume: the one-step-SFT model
    never succeeds, so under dynamic sampling every step is flat; step 1 is skipped and
    checkpointed, step 2 fails the run (2 in a row), and so does the resumed run's step 2."""
    cfg = load_config("configs/calculator.yaml", tiny_rl(
        calc_sft_dir, "rl.steps=3", "rl.max_idle_steps=1", "rl.algorithm={preset: dapo}",
        "checkpoint.every=1", "checkpoint.keep=5", "eval.tasks=2"))
    run = tmp_path / "run"
    two_in_a_row = r"^rl step 2: nothing to train \(2 step\(s\) in a row\)"
    with pytest.raises(RunError, match=two_in_a_row):
        train(cfg, run)
    (ckpt,) = complete_checkpoints(run)
    assert verify(ckpt).state["idle_steps"] == 1
    with pytest.raises(RunError, match=two_in_a_row):
        train(cfg, resume=run)
