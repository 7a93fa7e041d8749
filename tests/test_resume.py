"""Exact resume (issue 24): a run SIGKILLed at seeded moments (while it samples or trains, while
a checkpoint is half written) and resumed with `tiller train --resume` ends with the metrics
and the bit-identical weights of a run that was never stopped (rl.mode sync, the embedded
engine); in async every task is drawn once."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch
from helpers import RL_MOVES, TINY_RUN, cli, numbers, tiny_rl
from safetensors.torch import load_file

from tiller.checkpoints import MARKER, PAUSE_ENV, complete_checkpoints
from tiller.config import load_config
from tiller.controller import train
from tiller.errors import ConfigError
from tiller.plugins import load_env_class
from tiller.preflight import rl_task_count

ROOT = Path(__file__).resolve().parents[1]
# a tiny calculator run: SFT, 4 RL steps (a checkpoint after each) and the final eval
RUN = [*TINY_RUN, "sft.tasks=32", "rl.steps=4", "checkpoint.every=1", "checkpoint.keep=2",
       "eval.tasks=8"]
TIMEOUT_S = 180  # one tiller process, start to end


def tiller(*args: str, pause_s: float = 0.0) -> subprocess.Popen:
    """`python -m tiller ARGS` in its own process; `pause_s`: each checkpoint write waits
    that long before its marker (the test hook), so a kill can land inside one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           PAUSE_ENV: str(pause_s)}
    return subprocess.Popen([sys.executable, "-m", "tiller", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:]
    return out


def kill_when(proc: subprocess.Popen, ready, delay_s: float) -> bool:
    """SIGKILL `proc` `delay_s` after `ready()` first holds; False when it ended first."""
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the run never reached the kill point"
        time.sleep(0.02)
    time.sleep(delay_s)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    return True


def rl_rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(json.loads(line)["phase"] == "rl" for line in path.read_text().splitlines()
               if line.endswith("}"))


def writing_checkpoint(run: Path, after: int):
    """Whether a checkpoint past step `after` is being written: a temporary folder of one
    that was not there when asked (not one an earlier kill left)."""
    folder = run / "checkpoints"
    old = set(folder.glob(".step-*.tmp"))
    return lambda: any(int(p.name.split(".")[1].removeprefix("step-")) > after
                       for p in set(folder.glob(".step-*.tmp")) - old)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "final" / "model.safetensors")


# what the resumed process counts afresh: the engine's and the tool stack's own counters
FRESH = ("/calculate",)


def comparable(run: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("engine/")}
            for row in numbers(run, FRESH)]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [24, 5])
def test_sync_run_killed_at_seeded_moments_resumes_bit_identically(tmp_path, seed):
    ref, run = tmp_path / "ref", tmp_path / "run"
    finish(tiller("train", "configs/calculator.yaml", *RUN, "-o", str(ref)))
    rng = random.Random(seed)  # where each kill lands
    # 1: while step 2 samples or trains (a seeded moment after step 1's row)
    proc = tiller("train", "configs/calculator.yaml", *RUN, "-o", str(run))
    assert kill_when(proc, lambda: rl_rows(run) >= 1, rng.uniform(0.0, 0.6))
    kills = 1
    # 2: while a checkpoint is half written (each write pauses 3 s before its marker)
    done = max((c.step for c in complete_checkpoints(run)), default=0)
    writing = writing_checkpoint(run, done)
    proc = tiller("train", "--resume", str(run), pause_s=3.0)
    assert kill_when(proc, writing, rng.uniform(0.5, 2.0))
    kills += 1
    # the half-written one is not a checkpoint; the one before is intact
    assert [c.step for c in complete_checkpoints(run)][0] == done
    assert list((run / "checkpoints").glob(".step-*.tmp"))
    # 3: at a seeded moment after the start (start-up, rollouts or a train step)
    proc = tiller("train", "--resume", str(run))
    if kill_when(proc, lambda: True, rng.uniform(4.0, 9.0)):
        kills += 1
    out = finish(tiller("train", "--resume", str(run)))
    assert kills >= 2, out[-2000:]
    a, b = weights(ref), weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert comparable(run) == comparable(ref)
    assert not list((run / "checkpoints").glob(".step-*.tmp"))  # cut-short writes removed
    assert [c.step for c in complete_checkpoints(run)] == [4, 3]  # checkpoint.keep=2
    summary = json.loads((run / "summary.json").read_text())
    ref_summary = json.loads((ref / "summary.json").read_text())
    assert summary["rl"]["ledger"] == ref_summary["rl"]["ledger"]
    assert summary["heldout_after_rl"]["success"] == ref_summary["heldout_after_rl"]["success"]
    assert ({k: v for k, v in summary["heldout_after_sft"].items() if k != "time_s"}
            == {k: v for k, v in ref_summary["heldout_after_sft"].items() if k != "time_s"})


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["async", "one_step_off"])
def test_run_killed_with_open_groups_draws_every_task_once(tmp_path, mode):
    run = tmp_path / "run"
    over = [*RUN, f"rl.mode={mode}", "rl.steps=8"]
    proc = tiller("train", "configs/calculator.yaml", *over, "-o", str(run))
    assert kill_when(proc, lambda: rl_rows(run) >= 1, random.Random(6).uniform(0.0, 0.5))
    killed_at = json.loads((complete_checkpoints(run)[0].path / "state.json").read_text())
    finish(tiller("train", "--resume", str(run)))
    last = max(complete_checkpoints(run), key=lambda c: c.step)
    state = json.loads((last.path / "state.json").read_text())["manager"]
    # resumed with groups still open, and drawn from the stream past the checkpoint's position
    assert last.step == 8 and killed_at["step"] < 8 and killed_at["manager"]["open_tasks"]
    assert state["pulled"] > killed_at["manager"]["pulled"]
    # the stream the run draws from (run.rl_tasks: the tasks, then async's reserve)
    cfg = load_config("configs/calculator.yaml", over)
    env, n = load_env_class(cfg.env.name), rl_task_count(cfg)
    stream = [t.id for seed in ((3, 5) if mode == "async" else (3,))
              for t in env.make_tasks("train", n, cfg.seed + seed, cfg.env.difficulty)]
    drawn = state["draw_ids"] + [t["id"] for t in state["open_tasks"]]
    # every task up to the stream's position drawn exactly once: none skipped, none repeated
    assert sorted(drawn) == sorted(stream[: state["pulled"]])
    assert state["pulled"] >= 8 * 4  # at least the 8 steps' groups
    summary = json.loads((run / "summary.json").read_text())
    assert "ledger_unaccounted" not in summary["rl"] and summary["rl"]["ledger"]["trained"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished tiny run (2 RL steps) with a checkpoint after each."""
    run = tmp_path_factory.mktemp("resume") / "run"
    train(load_config("configs/calculator.yaml", [*RUN, "rl.steps=2", "checkpoint.keep=5"]),
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
    # a corrupt file in the newest checkpoint: named, and the checkpoint kept for a look
    newest = run / "checkpoints" / "step-000002"
    data = bytearray((newest / "trainer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "trainer.pt").write_bytes(bytes(data))
    refused(run, [], "step-000002 is corrupt: trainer.pt does not match")
    # another format (or tiller version)
    marker = json.loads((newest / MARKER).read_text())
    (newest / MARKER).write_text(json.dumps({**marker, "format": 99}))
    refused(run, [], "checkpoint format 99")
    # a partial one (no marker: never renamed into place whole) is skipped: step 1 is used
    (newest / MARKER).unlink()
    assert [c.step for c in complete_checkpoints(run)] == [1]
    shutil.rmtree(run / "checkpoints" / "step-000001")
    shutil.rmtree(newest)
    refused(run, [], "no complete checkpoint")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = cli("train", "--resume", empty)
    assert code == 2 and "not a run folder (no config.yaml)" in out


@pytest.mark.slow
def test_safe_change_resumes_and_checkpoints_are_listed(two_steps, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    shutil.rmtree(run / "checkpoints" / "step-000002")
    code, out = cli("checkpoints", run)
    assert code == 0 and "step-000001" in out and "complete" in out, out
    assert "optimizer" in out and "1 open" not in out  # sync: no open groups
    caplog.set_level("INFO")
    traced = trace_counts(two_steps)
    summary = train(load_config(run / "config.yaml", ["logging.tensorboard=false",
                                                      "eval.tasks=4"]), resume=run)
    assert "config changed (safe): eval.tasks: 8 -> 4" in caplog.text
    assert summary["resumed_from"] == "step-000001"
    assert summary["heldout_after_rl"]["tasks"] == 4
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase_step"] for r in rows if r["phase"] == "rl"] == [1, 2]  # step 2 redone
    assert (run / "metrics.discarded.jsonl").is_file()  # the killed run's rows, kept aside
    # traces append: step 2's episodes and ledger row once (the cut-off ones deleted), the
    # evaluation after RL once, of its 4 tasks now
    got = trace_counts(run)
    assert ("eval_rl", None, 4) in got and ("eval_rl", None, 8) in traced
    assert [r for r in got if r[0] != "eval_rl"] == [r for r in traced if r[0] != "eval_rl"]


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
    checks parity, before its first rollout, and ends as the run never stopped did."""
    from test_http_engine import server_version, servers

    run = tmp_path / "run"
    with servers(calc_sft_dir, 1, tmp_path / "servers") as s:
        cfg = load_config("configs/calculator.yaml", tiny_rl(
            calc_sft_dir, "model.dtype=float32", "rl.steps=2", "rl.tasks_per_step=4",
            "engine.backend=http", f"engine.urls={json.dumps(s.urls)}",
            f"engine.weights_dir={s.root / 'weights'}", "checkpoint.every=1",
            "checkpoint.keep=5"))
        train(cfg, run)
        whole = weights(run)
        rows = comparable(run)
        assert server_version(s.urls[0]) == 2
        shutil.rmtree(run / "checkpoints" / "step-000002")  # as if killed in step 2
        s.restart(0)  # the server died; it comes back holding its model folder's weights
        assert server_version(s.urls[0]) == 0
        summary = train(cfg, resume=run)
        assert summary["resumed_from"] == "step-000001"
        assert server_version(s.urls[0]) == 2
    resumed = weights(run)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert comparable(run) == rows


@pytest.mark.parametrize("setting, field", [
    ("rl.curriculum.enabled=true", "rl.curriculum"),
    ("train.world_size=2", "train.world_size > 1"),
])
def test_checkpoints_of_state_they_cannot_hold_are_refused_before_any_work(
        tmp_path, setting, field):
    cfg = load_config("configs/calculator.yaml", [*RUN, setting])
    with pytest.raises(ConfigError, match=re.escape(f"do not yet hold the state of {field}")):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [["rl.algorithm.preset=ppo", "rl.algorithm.advantage=gae"],
                                       ["rl.algorithm.kl.beta=0.05", *RL_MOVES]])
def test_critic_and_reference_model_resume_bit_identically(tmp_path, algorithm):
    """The critic's weights and optimizer (ppo), the reference model (kl.beta > 0) come back
    from trainer.pt: a resume from step 1 of 3 ends where the whole run did."""
    over = [*RUN, "rl.steps=3", "checkpoint.keep=5", *algorithm]
    whole = tmp_path / "whole"
    train(load_config("configs/calculator.yaml", over), whole)
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    for step in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step-00000{step}")
    saved = torch.load(run / "checkpoints" / "step-000001" / "trainer.pt", weights_only=True)
    assert "ref" in saved and ("critic" in saved) == ("ppo" in algorithm[0])  # ppo: KL too
    train(load_config("configs/calculator.yaml", over), resume=run)
    a, b = weights(whole), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert comparable(run) == comparable(whole)


@pytest.mark.slow
def test_more_steps_on_resume_continue_the_same_run(two_steps, tmp_path):
    """rl.steps raised on resume (a safe change): the finished 2-step run, resumed from its
    last checkpoint with rl.steps=3, ends as a 3-step run does."""
    whole = tmp_path / "whole"
    train(load_config("configs/calculator.yaml", [*RUN, "rl.steps=3"]), whole)
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    train(load_config(run / "config.yaml", ["rl.steps=3"]), resume=run)
    a, b = weights(whole), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rl = [[r for r in comparable(d) if r["phase"] == "rl"] for d in (whole, run)]
    assert rl[0] == rl[1] and len(rl[0]) == 3
