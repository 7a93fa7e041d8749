"""benchmarks/curriculum.py keeps running: its --quick smoke run fills the table from real
runs, and the figures it derives (steps to threshold, t-intervals, ratios) are hand-checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
bench = load_benchmark("curriculum")


def test_steps_to_threshold_and_intervals_hand_computed():
    curve = {0: 0.1, 4: 0.3, 8: 0.5, 12: 0.45}
    assert bench.steps_to(curve, 0.45) == 8 and bench.steps_to(curve, 0.1) == 0
    assert bench.steps_to(curve, 0.6) is None
    assert bench.curve_mean(curve) == pytest.approx((0.3 + 0.5 + 0.45) / 3)  # step 0 left out
    # mean 0.5, sd 0.1, n 3: half-width 4.30 * 0.1 / sqrt(3) = 0.248
    assert bench.mean_ci([0.4, 0.5, 0.6]) == "0.500 [0.252, 0.748]"
    assert bench.mean_ci([0.4]) == "0.400" and bench.mean_ci([]) == "-"
    assert bench.ratio(8, 4) == "2.00x" and bench.ratio(None, 4) == "-"
    assert bench.ratio(3, 0) == "-"
    flat = {"threshold": 0.0, "uniform": {"start": {"success": 0.0}}}
    assert not bench.uniform_gained(flat)  # no gain: steps-to-threshold would be 0, shown n/a
    assert bench.uniform_gained({**flat, "threshold": 0.1})


@pytest.mark.slow
@pytest.mark.integration
def test_quick_run_fills_the_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/curriculum.py", "--quick", "--seeds", "0", "1",
         "--shared-sft", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["seed"] for r in res] == [0, 1]
    assert res[0]["sft_checkpoint"] == res[1]["sft_checkpoint"]  # --shared-sft
    for r in res:
        for arm in bench.ARMS:
            assert sorted(map(int, r[arm]["curve"])) == [0, 1, 2]  # --quick: eval every step
            assert 0.0 <= r[arm]["final"]["success"] <= 1.0
            assert r[arm]["start"] == r["uniform"]["start"]  # one step-0 evaluation
        assert r["threshold"] == r["uniform"]["final"]["success"]
        # the difficulty curriculum logged its level every step (from level 1), the filter
        # one the target's; uniform logged none
        assert r["difficulty"]["levels"][0] == 1 and len(r["difficulty"]["levels"]) == 2
        assert r["filter"]["levels"] == [3.0, 3.0] and r["uniform"]["levels"] == []
        for arm in ("difficulty", "filter"):
            curve = {int(s): v for s, v in r[arm]["curve"].items()}
            expected = bench.steps_to(curve, r["threshold"]) if bench.uniform_gained(r) else None
            assert r["steps"][arm] == expected
            # the paired comparison is of the two arms' last evaluations, on the same tasks
            p = r["paired"][arm]
            assert p["tasks"] == 8
            assert p["success_a"] == r["uniform"]["final"]["success"]
            assert p["success_b"] == r[arm]["final"]["success"]
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("| seed | arm | SFT start | held-out at step 2 [95% CI]")
    assert [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| 0 |")] \
        == list(bench.ARMS)
    assert table.count("minus uniform (paired by seed)") == 2
    assert table.strip() in proc.stdout  # printed as written
    # --merge rebuilds the same table from results.json (runs of one seed each, merged), and
    # refuses a seed given twice
    assert bench.main(["--merge", str(tmp_path)]).strip() == table.strip()
    with pytest.raises(SystemExit, match="repeat a seed"):
        bench.main(["--merge", str(tmp_path), str(tmp_path)])


def test_quick_shrinks_the_budget_and_uniform_always_runs_first():
    args = bench.parse_args(["--quick"])
    assert (args.steps, args.eval_every, args.tasks_per_step, args.target) == (2, 1, 2, 3)
    assert bench.parse_args(["--arms", "filter"]).arms == ["uniform", "filter"]
    assert bench.parse_args(["--arms", "filter", "uniform", "difficulty"]).arms == list(bench.ARMS)


@pytest.mark.parametrize("argv, flag", [
    (["--quick", "--steps", "9"], "--steps"), (["--quick", "--sft-tasks", "9"], "--sft-tasks"),
    (["--sft-checkpoint", "x", "--sft-epochs", "2"], "--sft-epochs"),
    (["--sft-checkpoint", "x", "--shared-sft"], "--shared-sft")])
def test_flags_that_would_change_nothing_are_refused(argv, flag, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert f"drop {flag}" in capsys.readouterr().err


def test_arms_differ_only_in_the_curriculum():
    args = bench.parse_args([])
    assert bench.arm_overrides(args, "uniform") == []
    for arm in ("difficulty", "filter"):
        extra = bench.arm_overrides(args, arm)
        assert all(o.startswith("rl.curriculum.") for o in extra)
        assert f"rl.curriculum.mode={arm}" in extra
    assert {"rl.curriculum.pool=128", "rl.curriculum.max_skips=4"} <= set(
        bench.arm_overrides(args, "filter"))
    assert "rl.curriculum.max_skips=32" in bench.arm_overrides(
        bench.parse_args(["--max-skips", "32"]), "filter")
