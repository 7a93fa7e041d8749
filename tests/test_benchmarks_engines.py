"""benchmarks/engines.py at its smallest size on the embedded backends (in-process and a managed
`tiller serve`): the table has a row per backend with every column, the episodes ran every
turn, and each "vs hf" ratio is the cell's tokens/s over the HF row's of the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["model", "backend", "start s", "single tok/s", "vs hf", "multi tok/s", "vs hf",
           "turns/ep", "client ms/req", "client share"]


@pytest.mark.slow
@pytest.mark.integration
def test_smallest_run_on_the_embedded_backends(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "res.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/engines.py", "--models", "demo", "--backends",
         "hf,embedded,serve", "--prompts", "2", "--episodes", "2", "--turns", "3",
         "--max-new-tokens", "4", "--work", str(tmp_path), "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == COLUMNS
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[1] for c in cells] == ["hf", "embedded", "serve"]
    rows = {r["backend"]: r for r in res["rows"]}
    hf = rows["hf"]
    for c in cells:
        r = rows[c[1]]
        assert float(c[3]) == pytest.approx(r["single_tok_s"], abs=0.5) and r["single_tok_s"] > 0
        # the ratios: this run's tokens/s over this run's HF row (1.00x for HF itself)
        assert c[4] == f"{r['single_tok_s'] / hf['single_tok_s']:.2f}x"
        assert c[6] == f"{r['multi_tok_s'] / hf['multi_tok_s']:.2f}x"
        assert r["turns"] == 3.0  # every episode played all its turns (closed, not truncated)
    assert cells[0][4] == cells[0][6] == "1.00x"
    # the client cost: measured for the HTTP backend only, against a null server; a fraction
    # of the multi-turn run's wall time
    assert cells[0][8:] == cells[1][8:] == ["-", "-"]
    serve = rows["serve"]
    assert serve["client_ms"] > 0 and 0 < serve["client_share"] < 1
    assert cells[2][8:] == [f"{serve['client_ms']:.2f}", f"{100 * serve['client_share']:.1f}%"]
    assert res["sync"] == {} and res["rl"] == []


@pytest.mark.slow
@pytest.mark.integration
def test_smallest_run_on_vllm_with_weight_sync_and_an_rl_step(tmp_path):
    """The vLLM cell, its disk and shm pushes (--sync) and one RL step of `tiller train` through
    vLLM (--rl-steps): review s9-i21 F9. Two vLLM servers start (the cell's, the run's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "res.json"
    with subprocess.Popen(
            [sys.executable, "benchmarks/engines.py", "--models", "demo", "--backends", "vllm",
             "--prompts", "2", "--episodes", "2", "--turns", "2", "--max-new-tokens", "4",
             "--sync", "--repeats", "1", "--rl-steps", "1", "--work", str(tmp_path),
             "--json", str(out)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=900)
        finally:
            proc.kill()  # a no-op once it has exited
    assert proc.returncode == 0, stderr[-3000:]
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["backend"] == "vllm" and row["turns"] == 2.0 and row["client_ms"] > 0
    sync = res["sync"]["demo"]
    for path, load in (("disk", "/collective_rpc"), ("shm", "/update_weights")):
        assert 0 < sync[f"{path}_write_s"] < sync[f"{path}_push_s"]
        assert {"save", "/pause", load, "/resume"} <= set(sync[f"{path}_parts"])
    assert f"{sync['shm_push_s'] / sync['disk_push_s']:.2f}x |" in stdout
    (rl,) = res["rl"]
    assert rl["backend"] == "vllm" and rl["steps"] == 1 and rl["sync_s"] > 0
    assert "| vllm | 1 |" in stdout
    assert not list(Path("/dev/shm").glob(f"tiller-weights-{proc.pid}-*"))  # removed


@pytest.mark.slow
@pytest.mark.integration
def test_engine_process_at_its_smallest_size(tmp_path):
    """benchmarks/engine_process.py (the embedded engine in-process against a `tiller serve`
    process) with a short SFT and one RL step: both rows, rollout tokens counted, the printed
    tokens/s the JSON's (review s9-i21 F9)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "res.json"
    small = ["sft.tasks=64", "sft.epochs=1", "rl.steps=1", "eval.tasks=4",
             "rl.tasks_per_step=2", "rl.group_size=2"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/engine_process.py", "--work", str(tmp_path), "--json",
         str(out), *(a for kv in small for a in ("--set", kv))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res) == ["in-process (embedded)", "subprocess (tiller serve)"]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")][1:]
    for line, (name, r) in zip(lines, res.items(), strict=True):
        assert r["tokens"] > 0 and r["seconds"] > 0 and r["turns"] >= 1
        assert line == (f"| {name} | {r['tokens']:.0f} | {r['seconds']:.1f} | "
                        f"{r['tokens'] / r['seconds']:.0f} | {r['turns']:.2f} |")
