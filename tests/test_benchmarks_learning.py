"""benchmarks/learning.py keeps running: --quick runs each seed's main run and both controls
from it, pairs every comparison on the same tasks (the SFT evaluation of the random-reward run
is main's own), writes the tables, the examples and the CPU time, resumes, and stops loudly
naming the run whose `tiller train` failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import load_benchmark


@pytest.mark.slow
@pytest.mark.integration
def test_quick_run_writes_the_table_pairs_the_controls_and_resumes(tmp_path, capsys):
    bench = load_benchmark("learning")
    argv = ["--env", "calculator", "--quick", "--seeds", "0", "--jobs", "2",
            "--out", str(tmp_path)]
    bench.main(argv)
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "table.json").read_text())
    # configs/learning/calculator.yaml's three eval sets, each paired SFT vs RL
    assert [r["set"] for r in rows] == ["heldout", "ood_difficulty", "ood_templates"]
    for r in rows:
        assert r["rl_vs_sft"]["success_a"] == r["sft"]["success"]
        assert r["rl_vs_sft"]["success_b"] == r["rl"]["success"]
        assert r["random_vs_sft"]["success_a"] == r["sft"]["success"]
        assert r["random_vs_sft"]["success_b"] == r["random"]["success"]
        assert r["random_within_sft_ci"] == (
            r["sft"]["ci_low"] <= r["random"]["success"] <= r["sft"]["ci_high"])
        assert r["sft"]["tasks"] == r["rl_vs_sft"]["tasks"] == 8
        assert r["cpu_min"] > 0 and set(r["behaviour"]["sft"]) == set(bench.BEHAVIOUR)
        for split in r["tool_use"].values():  # every episode of the set, on one side
            assert split["with_tool"] + split["without_tool"] == 8
    assert "| 0 | heldout | 8 |" in out and "| heldout | 0." in out and "tool calls" in out
    assert "| seed | set | with a tool call | success with | without | correct without |" in out
    assert r["rl_vs_random"]["success_b"] == r["rl"]["success"] == r["rl_vs_cold"]["success_b"]
    seed = tmp_path / "seed0"
    random_cfg = yaml.safe_load((seed / "random/config.yaml").read_text())
    cold_cfg = yaml.safe_load((seed / "cold/config.yaml").read_text())
    assert random_cfg["rl"]["reward_control"] == "random"
    assert Path(random_cfg["model"]["path"]) == seed / "main/checkpoints/sft"
    assert Path(cold_cfg["model"]["path"]) == seed / "main/base_model"
    assert not random_cfg["sft"]["enabled"] and not cold_cfg["sft"]["enabled"]
    assert cold_cfg["rl"]["reward_control"] == "none"
    # the random-reward run starts from main's SFT checkpoint: the same evaluation, task by task
    sft_rows = (seed / "main/eval/sft.jsonl").read_text()
    assert sft_rows == (seed / "random/eval/sft.jsonl").read_text()
    assert (tmp_path / "examples.md").read_text().startswith("Seed 0, set heldout: ")
    stamps = {p: p.stat().st_mtime_ns for p in seed.glob("*/summary.json")}
    assert len(stamps) == 3
    bench.main(argv)  # resumes: nothing reruns, the same table
    assert {p: p.stat().st_mtime_ns for p in seed.glob("*/summary.json")} == stamps
    assert json.loads((tmp_path / "table.json").read_text()) == rows
    # an attempt that did not finish is deleted and rerun, never mixed with the new one
    (seed / "cold/summary.json").unlink()
    (seed / "cold/leftover").write_text("from the killed attempt")
    bench.main(argv)
    assert (seed / "cold/summary.json").is_file() and not (seed / "cold/leftover").exists()
    # a finished run made with another config is refused, not reused
    with pytest.raises(RuntimeError, match=r"^seed 0 main: .* holds a run made with another "
                       r"config \(sections rl differ\)"):
        bench.main([*argv, "--set", "rl.lr=1e-5"])


@pytest.mark.slow
@pytest.mark.integration
def test_a_failing_run_stops_the_benchmark_naming_it_and_its_log(tmp_path):
    bench = load_benchmark("learning")
    with pytest.raises(RuntimeError, match=r"^seed 0 main: tiller train exited 2 \(log: "
                       r".*seed0/main\.log\):\n.*rl.lr"):
        bench.main(["--env", "calculator", "--quick", "--seeds", "0", "--set", "rl.lr=-1",
                    "--out", str(tmp_path)])


@pytest.mark.parametrize("argv, words", [
    (["--set", "seed=7"], "--set seed=7: the benchmark sets seed"),
    (["--set", "rl.reward_control=random"], "--set rl.reward_control=random"),
    (["--seeds", "0", "0"], "--seeds: each seed once"),
    (["--random-seeds", "5"], "--random-seeds and --cold-seeds must be among --seeds"),
    (["--model", "smollm2", "--quick"], "--quick builds a tiny model: not with --model smollm2"),
])
def test_options_that_would_make_the_runs_something_else_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        load_benchmark("learning").parse_args(["--env", "calculator", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_model_smollm2_runs_the_real_model_config_one_run_at_a_time_without_the_cold_control(
        capsys):
    bench = load_benchmark("learning")
    args = bench.parse_args(["--env", "calculator", "--model", "smollm2"])
    assert args.config == bench.ROOT / "configs/smollm2_calculator.yaml"
    assert args.out == bench.ROOT / "runs/learning/calculator-smollm2"
    assert (args.jobs, args.seeds, args.random_seeds, args.cold_seeds) == (1, [0, 1, 2],
                                                                         [0, 1, 2], [])
    # a cold control asked for starts from the config's pretrained model, not a built one
    args = bench.parse_args(["--env", "calculator", "--model", "smollm2", "--cold-seeds", "0"])
    cold = bench.overrides(args, 0, "cold")
    assert 'model.path="smollm2-135m-instruct"' in cold and "sft.enabled=false" in cold
    random = bench.overrides(args, 0, "random")
    assert f'model.path="{args.out / "seed0/main/checkpoints/sft"}"' in random
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--env", "search", "--model", "smollm2"])
    assert e.value.code == 2
    assert "--model smollm2: its config is for --env calculator only" in capsys.readouterr().err


def test_tool_use_splits_each_evaluation_by_whether_the_episode_called_a_tool(tiny_run):
    """Every evaluated episode is on one side, and the two sides' successes add up to the
    evaluation's success rate; the episodes without a tool call are counted by traces."""
    bench = load_benchmark("learning")
    run, summary = tiny_run
    for label in ("sft", "rl"):
        split = bench.tool_use(run, "heldout", label, summary["seed"])
        n, result = split["with_tool"] + split["without_tool"], summary[f"heldout_after_{label}"]
        assert n == result["tasks"] == 16
        correct = sum(split[f"success_{side}"] * split[side] for side in
                      ("with_tool", "without_tool") if split[side])
        assert correct == pytest.approx(result["success"] * n)
        assert split["correct_without_tool"] == pytest.approx(
            (split["success_without_tool"] or 0.0) * split["without_tool"])
