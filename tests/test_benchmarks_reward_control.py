"""benchmarks/reward_control.py keeps running: --quick from an SFT checkpoint prints one row
per seed and the mean, saves table.json, evaluates the SFT model identically in both runs of
a seed (the same model, tasks and seeds), and reuses finished runs when run again."""

from __future__ import annotations

import json

import pytest
from helpers import load_benchmark


@pytest.mark.slow
def test_quick_run_prints_the_table_and_resumes(calc_sft_dir, tmp_path, capsys):
    bench = load_benchmark("reward_control")
    argv = ["--quick", "--sft", str(calc_sft_dir), "--seeds", "0", "1", "--out", str(tmp_path)]
    bench.main(argv)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in lines[1:]] == ["| 0", "| 1", "| mean"]
    rows = json.loads((tmp_path / "table.json").read_text())
    assert [r["seed"] for r in rows] == [0, 1]
    for r in rows:
        assert r["sft"]["tasks"] == r["real"]["tasks"] == r["random"]["tasks"] == 8
        assert r["real_vs_sft"]["tasks"] == 8 and 0.0 <= r["real_vs_sft"]["p_value"] <= 1.0
    for seed in (0, 1):
        none = (tmp_path / f"seed{seed}/none/eval/sft.jsonl").read_text()
        assert none == (tmp_path / f"seed{seed}/random/eval/sft.jsonl").read_text()
        config = (tmp_path / f"seed{seed}/random/config.yaml").read_text()
        assert "reward_control: random" in config
    stamp = (tmp_path / "seed0/none/summary.json").stat().st_mtime_ns
    bench.main(argv)  # everything is there: only the table again
    assert (tmp_path / "seed0/none/summary.json").stat().st_mtime_ns == stamp
    assert capsys.readouterr().out == out
