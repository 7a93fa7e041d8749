"""Exact resume under cluster.backend ray (issues 22 and 24): a ray run whose process is SIGKILLed
at seeded moments (while it samples or trains, inside a checkpoint write) and resumed with
`tiller train --resume` ends with the metrics and the bit-identical weights of a ray run never
stopped (rl.mode sync, two rollout workers with embedded engines). After every kill nothing of
the killed run's local Ray instance is left: no process marked as one of it
(`rollout.ray_reaper`), no instance folder; the resumed run starts a fresh instance and its
workers, and pushes the checkpoint's weights to every worker's engine with the parity check
before its first rollout."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers import RL_MOVES, env_below
from safetensors.torch import load_file
from test_resume import (
    RUN,
    comparable,
    drawn_once,
    finish,
    kill_mid_checkpoint,
    kill_when,
    resume_logged,
    rl_rows,
    tiller,
    weights,
)

from tiller.checkpoints import complete_checkpoints, verify
from tiller.rollout import ray_reaper
from tiller.rollout.ray_reaper import INSTANCE_ENV, REAP_TIMEOUT_S

RAY = [*RUN, *RL_MOVES, "cluster.backend=ray", "cluster.rollout_workers=2"]


def instance_processes(tmp: Path) -> list[str]:
    """This user's processes marked as of a Ray instance whose folder is below `tmp` (each
    `pid command`)."""
    found = []
    for pid in env_below(INSTANCE_ENV, tmp):
        try:
            found.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:80]!r}")
        except OSError:  # gone since
            continue
    return found


def nothing_left(tmp: Path) -> None:
    """Within the guard's time: no process of the runs' Ray instances below `tmp`, and no
    instance folder."""
    deadline = time.monotonic() + REAP_TIMEOUT_S + 10
    while ((instance_processes(tmp) or list(tmp.glob("tiller-ray-*")))
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert not instance_processes(tmp), "a process of a killed run's Ray instance lives on"
    assert not list(tmp.glob("tiller-ray-*")), "a Ray instance's folder was left"


@pytest.fixture(scope="module")
def ray_tmp():
    """TMPDIR of the tiller processes (their local Ray instances' folders go there): a short
    private folder (Ray's socket paths live below it), removed at the end."""
    tmp = Path(tempfile.mkdtemp(prefix="tray-", dir="/tmp"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp))  # read by `tiller` (test_resume) at each start
        yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_whole(tmp_path_factory, ray_tmp) -> Path:
    """The uninterrupted ray run the killed ones are compared with."""
    ref = tmp_path_factory.mktemp("ray") / "ref"
    finish(tiller("train", "configs/calculator.yaml", *RAY, "-o", str(ref)))
    nothing_left(ray_tmp)
    assert not (ref / "ray_reaper.log").exists()  # an orderly shutdown leaves nothing to kill
    return ref


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed, phases", [(24, ("files", "rename")), (5, ("marker", "remove"))])
def test_ray_run_killed_at_seeded_moments_resumes_bit_identically(ray_whole, ray_tmp,
                                                                  tmp_path, seed, phases):
    """Three kills, each asserted to land: at a seeded moment after step 2's row (step 3's
    rollouts in the workers, its train step, or checkpoint 2's write), then inside two
    checkpoint writes at phases of the test hook (the four over the two seeds), each at a
    seeded moment of the pause; then the resume."""
    ref, run = ray_whole, tmp_path / "run"
    rng = random.Random(seed)
    proc = tiller("train", "configs/calculator.yaml", *RAY, "-o", str(run))
    kill_when(proc, lambda: rl_rows(run) >= 2, rng.uniform(0.0, 0.3))
    nothing_left(ray_tmp)
    for phase in phases:
        kill_mid_checkpoint(run, phase, rng)
        nothing_left(ray_tmp)
    assert "of its processes left were killed" in (run / "ray_reaper.log").read_text()
    ckpt = verify(complete_checkpoints(run)[0])
    out = resume_logged(run)
    nothing_left(ray_tmp)
    # a fresh instance and workers; the checkpoint's weights pushed to both workers' engines
    # and checked there before the first rollout
    v = ckpt.state["trainer_version"]
    pushed = re.search(rf"weight sync v{v}: full, ", out)
    assert pushed and f"weight sync v{v}: parity checked on rollout worker 0, rollout worker 1 (" \
        in out[pushed.end():], out[-3000:]
    a, b = weights(ref), weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sft = load_file(run / "checkpoints" / "sft" / "model.safetensors")
    assert not all(torch.equal(a[k], sft[k]) for k in a)  # RL moved the weights
    assert comparable(run) == comparable(ref)
    assert [c.step for c in complete_checkpoints(run)] == [4, 3]  # checkpoint.keep=2
    summary = json.loads((run / "summary.json").read_text())
    ref_summary = json.loads((ref / "summary.json").read_text())
    assert summary["resumed_from"] == ckpt.path.name
    assert summary["rl"]["ledger"] == ref_summary["rl"]["ledger"]
    assert summary["heldout_after_rl"]["success"] == ref_summary["heldout_after_rl"]["success"]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_one_step_off_ray_run_killed_with_open_groups_draws_every_task_once(ray_tmp, tmp_path):
    """one_step_off under ray: the checkpoint holds the next step's groups open (their
    episodes were running in the workers); the resumed run samples them again first, with
    their first seeds, and draws every task of the stream once."""
    run, over = tmp_path / "run", [*RAY, "rl.mode=one_step_off", "rl.steps=8"]
    proc = tiller("train", "configs/calculator.yaml", *over, "-o", str(run))
    kill_when(proc, lambda: rl_rows(run) >= 1, random.Random(6).uniform(0.0, 0.5))
    nothing_left(ray_tmp)
    killed_at = verify(complete_checkpoints(run)[0]).state
    assert killed_at["manager"]["open_tasks"]  # resumed with groups still open
    finish(tiller("train", "--resume", str(run)))
    nothing_left(ray_tmp)
    drawn_once(run, over, "one_step_off", killed_at)


def test_the_guard_kills_the_instances_processes_and_only_them(tmp_path):
    """`ray_reaper` once its pipe ends: the processes marked with its instance's folder are
    killed and the folder removed, a process marked with another folder (or not at all) is
    left, and what it did is one line of its log; status 1 (it killed some)."""
    folder, log = tmp_path / "tiller-ray-x", tmp_path / "ray_reaper.log"
    folder.mkdir()
    guard = subprocess.Popen([sys.executable, "-I", ray_reaper.__file__, str(folder), str(log)],
                             stdin=subprocess.PIPE)
    sleepers = {name: subprocess.Popen(["sleep", "60"], env={**os.environ, **marks})
                for name, marks in [("ours", {INSTANCE_ENV: str(folder)}),
                                    ("other", {INSTANCE_ENV: f"{folder}-other"}),
                                    ("unmarked", {})]}
    try:
        guard.stdin.close()
        assert guard.wait(timeout=REAP_TIMEOUT_S + 10) == 1
        assert sleepers["ours"].wait(timeout=10) == -9
        assert sleepers["other"].poll() is None and sleepers["unmarked"].poll() is None
        assert not folder.exists()
        assert re.fullmatch(rf"\S+ Ray instance {re.escape(str(folder))}: the run's process "
                            rf"ended; 1 of its processes left were killed "
                            rf"\[{sleepers['ours'].pid}\]; its folder removed\n",
                            log.read_text())
    finally:
        for p in [guard, *sleepers.values()]:
            p.kill()
            p.wait(timeout=10)


def test_the_guard_after_an_orderly_shutdown_kills_nothing_and_logs_nothing(tmp_path):
    folder, log = tmp_path / "tiller-ray-x", tmp_path / "ray_reaper.log"
    folder.mkdir()
    guard = subprocess.Popen([sys.executable, "-I", ray_reaper.__file__, str(folder), str(log)],
                             stdin=subprocess.PIPE)
    guard.stdin.close()
    assert guard.wait(timeout=REAP_TIMEOUT_S + 10) == 0
    assert not folder.exists() and not log.exists()
