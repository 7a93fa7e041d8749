"""benchmarks/resume_async.py keeps running: --quick trains its SFT checkpoint, runs async
uninterrupted and killed + resumed, and prints both held-out successes and the ledger line
(the tiny policy learns nothing, so the learning outcome is not asserted here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_quick_run_prints_both_successes_and_every_task_drawn_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/resume_async.py", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1100)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = proc.stdout
    assert ("ledger: every task drawn exactly once: uninterrupted yes, killed + resumed yes"
            in out), out
    got = json.loads((tmp_path / "table.json").read_text())
    ref, resumed = got["rows"]
    for row in got["rows"]:  # each run's success and CI printed as the summary holds them
        h = row["heldout"]
        assert re.search(rf"\| {re.escape(row['run'])} \| 6 \|.*\| {h['success']:.3f} "
                         rf"\[{h['ci_low']:.3f}, {h['ci_high']:.3f}\] \| 16 \|", out), out
        assert row["ledger"]["drawn"] == row["ledger"]["pulled"] >= 6 * 4
    assert 1 <= resumed["from_step"] < 6 and resumed["open_groups"] > 0
    assert got["inside_ci"] == (ref["heldout"]["ci_low"] <= resumed["heldout"]["success"]
                                <= ref["heldout"]["ci_high"])
    assert f"resumed success {resumed['heldout']['success']:.3f} inside" in out
