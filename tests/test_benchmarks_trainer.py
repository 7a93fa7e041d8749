"""benchmarks/trainer.py at its smallest: every row measured, LoRA's against its full
fine-tuning row from the same run, and the bytes it reports are the model's."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
trainer = load_benchmark("trainer")


def test_best_keeps_the_fastest_run_and_the_highest_peak():
    runs = [{"seconds": 3.0, "cpu_seconds": 2.5, "tokens": 8, "peak_gb": 1.0},
            {"seconds": 2.0, "cpu_seconds": 2.6, "tokens": 8, "peak_gb": 0.9}]
    assert trainer.best(runs) == {"seconds": 2.0, "cpu_seconds": 2.5, "tokens": 8,
                                  "peak_gb": 1.0}


def test_lora_goal_is_cpu_time_at_most_six_tenths_of_full():
    rows = {"chunked": {"cpu_seconds": 10.0}, "lora": {"cpu_seconds": 6.0},
            "all": {"cpu_seconds": 10.0}, "lora-all": {"cpu_seconds": 6.1}}
    assert trainer.lora_goals(rows) == {"lora": True, "lora-all": False}
    assert trainer.lora_goals({"lora": rows["lora"]}) == {}  # nothing to compare with


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_smallest_run_prints_lora_against_full_fine_tuning():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trainer.py"), "--layers", "1", "--rows",
         "2", "--tokens", "32", "--threads", "1", "--configs", "chunked,lora", "--repeat", "2"],
        env=env, capture_output=True, text=True, timeout=280, check=True).stdout
    assert "best of 2" in out
    chunked = re.search(r"^chunked +[\d.]+ +nan +([\d.]+) +nan +([\d.]+) *$", out, re.M)
    lora = re.search(r"^lora +[\d.]+ +nan +([\d.]+) +nan +([\d.]+) +([\d.]+) +([\d.]+)$",
                     out, re.M)
    assert chunked and lora, out
    # x full: the per-token times' ratio, wall and CPU
    for ms, x, full in ((1, 2, 1), (3, 4, 2)):
        assert float(lora.group(x)) == pytest.approx(
            float(lora.group(ms)) / float(chunked.group(full)), rel=0.02, abs=0.01)
    # 1 layer, hidden 576: q_proj 576 -> 576 and v_proj 576 -> 192 at r 8, fp32
    adapter_mb = 4 * 8 * (576 + 576 + 576 + 192) / 1e6
    assert f"lora: adapter {adapter_mb:.2f} MB" in out
    assert re.search(r"^goal lora <= 0.6x chunked \(CPU time\): (met|missed)$", out, re.M)
