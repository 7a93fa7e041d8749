"""benchmarks/shard_sync.py keeps running: its --quick smoke run measures both paths on both
models, and the figures mean what they say (timings are not asserted beyond being measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
def test_quick_run_measures_both_paths(calc_model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "benchmarks/shard_sync.py", "--quick", "--model", str(calc_model_dir),
         "--work", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=850)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "shard_sync.json").read_text())
    assert [r["model"].split()[0] for r in res["rows"]] == ["demo", "qwen3"]
    for r in res["rows"]:
        g, p = r["gathered"], r["per_rank"]
        # the same model: the same full bytes either way, and the first sync is full
        assert g["sync/full_bytes"] == p["sync/full_bytes"] == g["first_bytes"] == p[
            "first_bytes"]
        # fp32 gathered (tied names each counted: the state dict's), bf16 synced
        assert g["gather_bytes"] >= 2 * g["sync/full_bytes"]
        assert p["sync/part0_bytes"] + p["sync/part1_bytes"] == pytest.approx(p["sync/bytes"])
        assert min(g["gather_s"], g["sync/time_s"], p["sync/time_s"], p["sync/part0_s"],
                   p["sync/part1_s"]) > 0
