"""runtime.threads: the default rule on given machines and models (hand-computed), what a run
applies (torch in the trained process, the environment of a process it starts, runtime.json),
and a bad value as one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from helpers import cli, saved_model

from tiller import runtime
from tiller.config import load_config
from tiller.errors import ConfigError
from tiller.run import Run, compute_streams
from tiller.runtime import THREAD_VARS, TINY_PARAMS, choose_threads, default_threads, thread_env
from tiller.tools.sandbox import Sandbox, SandboxLimits

DEMO = 524_288  # about the demo model's parameters (0.5M): above TINY_PARAMS


@pytest.fixture(autouse=True)
def restore_threads(monkeypatch):
    """A test may set this process's threads and thread variables: put them back after."""
    threads, saved = torch.get_num_threads(), {v: os.environ.get(v) for v in THREAD_VARS}
    monkeypatch.setattr(runtime, "_written", None)
    monkeypatch.setattr(runtime, "_before", None)
    yield
    torch.set_num_threads(threads)
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


@pytest.mark.parametrize(("cores", "load", "params", "streams", "expected"), [
    (2, 0.0, DEMO, 1, 2),       # idle 2-core machine: both cores
    (2, 0.4, DEMO, 1, 2),       # floor(2 - 0.4 + 0.5) = floor(2.1) = 2
    (2, 0.5, DEMO, 1, 2),       # floor(2.0) = 2: a half rounds up
    (2, 0.6, DEMO, 1, 1),       # floor(1.9) = 1
    (2, 2.0, DEMO, 1, 1),       # two busy processes beside it (issue 19): 1
    (2, 7.3, DEMO, 1, 1),       # free is at least 1
    (2, 0.0, DEMO, 2, 1),       # engine and trainer at once share the 2 cores
    (16, 3.2, DEMO, 2, 6),      # free = floor(13.3) = 13, 13 // 2 = 6
    (16, 0.0, DEMO, 3, 5),      # 16 // 3
    (16, 0.0, TINY_PARAMS - 1, 1, 1),  # a tiny model: 1 whatever the cores
    (16, 0.0, TINY_PARAMS, 1, 16),
    (1, 0.0, 10**9, 1, 1),
])
def test_default_rule_hand_computed(cores, load, params, streams, expected):
    assert default_threads(cores, load, params, streams) == expected


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], 1),                                                      # sync: engine, then trainer
    (["rl.mode=async"], 2),                                       # engine and trainer at once
    (["rl.mode=one_step_off"], 2),
    (["rl.mode=async", "rl.steps=0"], 1),                         # no training to overlap
    (["rl.mode=one_step_off", "rl.judge.model=/m"], 3),           # + the judge's worker
    (["rl.judge.model=/m"], 2),                                   # judge beside the engine
    (["engine.backend=http", "engine.urls=[http://127.0.0.1:1]"], 1),  # the trainer only
    (["engine.backend=http", "engine.urls=[http://127.0.0.1:1]", "rl.mode=async"], 1),
])
def test_compute_streams(overrides, expected):
    assert compute_streams(load_config("configs/calculator.yaml", overrides)) == expected


def test_auto_takes_the_users_omp_num_threads_not_its_own(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads("auto", params=DEMO, streams=1) == runtime.ThreadChoice(
        3, "OMP_NUM_THREADS")
    runtime.apply_threads(1)  # writes OMP_NUM_THREADS=1 for the children
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert choose_threads("auto", params=DEMO, streams=1).threads == 3  # still the user's
    assert choose_threads(2, params=DEMO, streams=1) == runtime.ThreadChoice(2, "runtime.threads")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(runtime, "_written", None)
    chosen = choose_threads("auto", params=DEMO, streams=1)
    assert chosen.source == "auto" and chosen.threads == default_threads(
        runtime.usable_cores(), chosen.rule["load_1min"], DEMO, 1)


def test_bad_omp_num_threads_is_one_line(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    with pytest.raises(ConfigError) as e:
        choose_threads("auto", params=DEMO, streams=1)
    assert "\n" not in str(e.value) and "OMP_NUM_THREADS='lots'" in str(e.value)


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "many", "true", "null"])
def test_bad_threads_value_is_one_line(value):
    with pytest.raises(ConfigError) as e:
        load_config("configs/calculator.yaml", [f"runtime.threads={value}"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config field runtime.threads: got ")
    assert msg.endswith("expected auto or a whole number of threads, at least 1")


def test_serve_refuses_bad_threads_in_one_line(tmp_path):
    code, out = cli("serve", tmp_path, "--threads", "0")
    assert code == 2
    lines = out.strip().splitlines()
    assert lines == ["error: --threads 0: expected auto or a whole number of threads, at least 1"]


def _run(calc_model_dir, tmp_path, threads: str) -> Run:
    cfg = load_config("configs/calculator.yaml", [
        *saved_model(calc_model_dir), "sft.enabled=false", f"runtime.threads={threads}"])
    return Run(cfg, tmp_path / f"run-{threads}")


def _in_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=60)
    return out[0]


@pytest.mark.slow
@pytest.mark.integration
def test_run_applies_its_threads(calc_model_dir, tmp_path):
    for threads in (2, 1):  # each run sets them, whatever the one before did
        run = _run(calc_model_dir, tmp_path, str(threads))
        try:
            assert torch.get_num_threads() == threads
            # the engine's worker and the trainer's threads take the process's count
            assert _in_new_thread(torch.get_num_threads) == threads
            record = json.loads((run.dir / "runtime.json").read_text())
            assert record == run.runtime
            assert record["threads"] == record["torch_threads"] == threads
            assert record["source"] == "runtime.threads" and record["rule"] is None
            assert record["child_env"] == thread_env(threads)
            # a process the run starts (a tool's program, a `tiller serve`) inherits them
            child = subprocess.run(
                [sys.executable, "-c", "import os, torch; print(torch.get_num_threads(), "
                 "*(os.environ[v] for v in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', "
                 "'OPENBLAS_NUM_THREADS', 'RAYON_NUM_THREADS')))"],
                capture_output=True, text=True, timeout=300, check=True)
            assert child.stdout.split() == [str(threads)] * 5
        finally:
            run.close()


def test_run_auto_rule_on_a_tiny_model(calc_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    run = _run(calc_model_dir, tmp_path, "auto")
    try:
        params = sum(p.numel() for p in run.model.parameters())
        assert params < TINY_PARAMS  # the tests' model (hidden 64): 1 thread on any machine
        record = json.loads((run.dir / "runtime.json").read_text())
        assert record["source"] == "auto" and record["threads"] == 1
        assert record["rule"]["parameters"] == params and record["rule"]["streams"] == 1
        assert record["rule"]["usable_cores"] == runtime.usable_cores()
        assert torch.get_num_threads() == 1
    finally:
        run.close()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_sandboxed_programs_get_one_thread_whatever_the_run_has():
    runtime.apply_threads(2)
    code = f"import os; print(*(os.environ.get(v) for v in {THREAD_VARS!r}))"
    r = Sandbox(SandboxLimits(wall_seconds=10), backend="bwrap").run_python(code)
    assert r.stdout.split() == ["1"] * len(THREAD_VARS), r.stderr
