"""benchmarks/truncation.py keeps running: its --quick run measures both methods in fresh
processes, they compute the same numbers, and the ratios and table are what the rows say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
bench = load_benchmark("truncation")


def test_table_hand_computed():
    rows = [{"rows": 1024, "vocab": 49152, "setting": "top_p 0.9", "kept": 35, "method": m,
             "seconds": s, "peak_mib": mib, "grad_mib": 192.0, "time_vs_old": s / 8.0,
             "memory_vs_old": mib / 1680.0} for m, s, mib in [("old", 8.0, 1680.0),
                                                               ("new", 2.0, 336.0)]]
    lines = bench.table(rows).splitlines()
    assert lines[0].startswith("| rows x vocab | truncation | kept (median) | method |")
    assert lines[3] == "| 1024 x 49152 | top_p 0.9 | 35 | new | 2.00 | 336 | 192 | 0.25x | 0.20x |"


@pytest.mark.slow
def test_quick_run_measures_both_methods_on_the_same_numbers(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "benchmarks/truncation.py", "--quick", "--json",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["setting"], r["method"]) for r in rows] == [
        (s, m) for s in ("top_p 0.9", "top_k 50") for m in ("old", "new")]
    for old, new in zip(rows[::2], rows[1::2], strict=True):
        assert new["checksum"] == pytest.approx(old["checksum"], rel=1e-5)  # same logp + H
        assert new["kept"] == old["kept"]
        assert new["time_vs_old"] == pytest.approx(new["seconds"] / old["seconds"])
        assert new["memory_vs_old"] == pytest.approx(new["peak_mib"] / old["peak_mib"])
        assert old["time_vs_old"] == old["memory_vs_old"] == 1.0
    assert rows[2]["kept"] == 50 and 1 < rows[0]["kept"] < 50  # top_k 50; a peaked nucleus
    assert all(r["seconds"] > 0 and r["peak_mib"] > 0 for r in rows)
    assert bench.table(rows).splitlines()[0] in proc.stdout
