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
           "turns/ep", "client share"]


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
    # the client share: measured for the HTTP backend only, a fraction of its engine time
    assert cells[0][8] == cells[1][8] == "-"
    assert 0 < rows["serve"]["client_share"] < 1
    assert res["sync"] == {} and res["rl"] == []
