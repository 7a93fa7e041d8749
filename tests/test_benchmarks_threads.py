"""benchmarks/threads.py keeps running: its --quick run fills the four-way table from real
`tiller train` processes whose torch thread count is the one asked for, its ratios are
hand-checked, and the busy processes it starts are gone when it ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

from tiller.runtime import default_threads

ROOT = Path(__file__).resolve().parents[1]
bench = load_benchmark("threads")


def _row(load: str, setting: str, sft_s: float) -> dict:
    return {"load": load, "setting": setting, "torch_threads": 1 if setting == "1" else 2,
            "sft_s": sft_s, "cpu_s": 10.0, "load_1min": 0.5}


def test_ratios_and_table_hand_computed():
    # the figures: idle 49.1 / 29.1 s, loaded 78.1 / 120.0 s (1 / 2 threads)
    rows = bench.with_ratios([_row("idle", "1", 49.1), _row("idle", "2", 29.1),
                              _row("loaded", "1", 78.1), _row("loaded", "2", 120.0)], "2")
    assert [round(r["vs_idle_before"], 3) for r in rows] == [1.687, 1.0, 2.684, 4.124]
    assert [round(r["vs_before"], 3) for r in rows] == [1.687, 1.0, 0.651, 1.0]
    lines = bench.table(rows, "2").splitlines()
    assert lines[0].startswith("| load | runtime.threads | torch threads | SFT s |")
    assert lines[4] == "| loaded | 1 | 1 | 78.1 | 10.0 | 0.50 | 2.68x | 0.65x |"


@pytest.mark.slow
@pytest.mark.integration
def test_quick_run_measures_each_setting_under_each_load(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/threads.py", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "threads.json").read_text())
    settings = list(dict.fromkeys(["1", "2", "auto", res["before"]]))
    rows = res["rows"]
    assert [(r["load"], r["setting"]) for r in rows] == [
        (load, s) for load in ("idle", "loaded") for s in settings]
    for r in rows:
        assert r["sft_steps"] == 2 and r["sft_s"] > 0 and r["cpu_s"] > 0
        if r["setting"] == "auto":  # the rule, not the OMP_NUM_THREADS=1 of this test's env
            rule = r["rule"]
            assert r["torch_threads"] == r["threads"] == default_threads(
                rule["usable_cores"], rule["load_1min"], rule["parameters"], rule["streams"])
        else:  # the knob changed torch's count in the measured process
            assert r["torch_threads"] == r["threads"] == int(r["setting"])
            assert r["rule"] is None
    base = {r["load"]: r["sft_s"] for r in rows if r["setting"] == res["before"]}
    for r in rows:
        assert r["vs_before"] == pytest.approx(r["sft_s"] / base[r["load"]])
        assert r["vs_idle_before"] == pytest.approx(r["sft_s"] / base["idle"])
    table = (tmp_path / "threads.md").read_text().splitlines()
    assert len(table) == 2 + len(rows) and table[0] in proc.stdout
    assert len(res["busy_pids"]) == 2
    for pid in res["busy_pids"]:  # stopped and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
