"""Evaluation a skeptic accepts: named eval sets (held-out, harder, unseen templates) under
several sampling seeds with per-episode outcomes on disk, `tiller eval RUN_DIR` and
`tiller eval CONFIG --model PATH`, and `tiller compare`'s paired test (bootstrap + exact
McNemar) that refuses runs evaluated on different tasks."""

from __future__ import annotations

import asyncio
import json
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_RUN, cli
from typer.testing import CliRunner

from tiller.cli import app
from tiller.config import ConfigError, load_config
from tiller.controller import train
from tiller.envs import ENVS
from tiller.envs.calculator import make_tasks
from tiller.envs.sql import SqlEnv, build_db, snapshot
from tiller.envs.sql import make_tasks as sql_tasks
from tiller.models import train_tokenizer
from tiller.observe.compare import compare, load_outcomes, sign_test
from tiller.observe.traces import connect
from tiller.rollout.agent_loop import EpisodeLimits
from tiller.rollout.collect import collect_expert
from tiller.tools.registry import ToolCall

CONFIG = "configs/calculator.yaml"
SETS = ("eval.sets=[{name: heldout, tasks: 6}, {name: ood_difficulty, tasks: 6, difficulty: 4}, "
        "{name: ood_templates, split: ood_templates, tasks: 6}]")


def rows(outcomes: dict[str, list[int]], set_name: str = "heldout") -> list[dict]:
    return [{"set": set_name, "task_id": t, "seed": 0, "sample": k, "success": bool(s)}
            for t, ss in outcomes.items() for k, s in enumerate(ss)]


# ---------------------------------------------------------------- the statistics


def test_sign_test_is_the_exact_binomial():
    assert sign_test(0, 5) == pytest.approx(2 / 32)
    assert sign_test(10, 2) == sign_test(2, 10) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert sign_test(3, 3) == 1.0 and sign_test(0, 0) == 1.0
    assert sign_test(0, 1) == 1.0  # min(1, 2 * 1/2)


def test_compare_pairs_on_task_ids():
    a = rows({f"t{i}": [i < 4] for i in range(20)})  # 4 of 20
    b = rows({f"t{i}": [i < 12] for i in reversed(range(20))})  # 12 of 20, other row order
    r = compare(a, b)
    assert (r["tasks"], r["success_a"], r["success_b"]) == (20, 0.2, 0.6)
    assert r["diff"] == pytest.approx(0.4) and (r["b_better"], r["a_better"]) == (8, 0)
    assert r["p_value"] == pytest.approx(2 / 2**8)
    assert 0.15 < r["diff_ci_low"] < 0.4 < r["diff_ci_high"] <= 0.65
    # several samples per task: per-task means are paired, the sign test counts tasks
    a2 = rows({"x": [1, 0], "y": [0, 0], "z": [1, 1]})
    b2 = rows({"x": [1, 1], "y": [0, 1], "z": [1, 1]})
    r2 = compare(a2, b2)
    assert r2["diff"] == pytest.approx(np.mean([0.5, 0.5, 0.0]))
    assert (r2["b_better"], r2["a_better"]) == (2, 0)


def test_compare_refuses_other_task_lists_and_missing_sets():
    a = rows({"t1": [1], "t2": [0]})
    with pytest.raises(ConfigError, match=r"different task lists for set 'heldout': 2 and 2 "
                                          r"tasks, 1 shared"):
        compare(a, rows({"t1": [1], "t3": [0]}))
    with pytest.raises(ConfigError, match=r"no eval set 'ood' \(it has: heldout\)"):
        compare(a, a, "ood")


def test_load_outcomes_names_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_outcomes(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"has no evaluations \(eval/\*.jsonl\)"):
        load_outcomes(str(tmp_path))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval/sft.jsonl").write_text(json.dumps(rows({"t": [1]})[0]) + "\n")
    (tmp_path / "eval/rl.jsonl").write_text('{"set": "heldout"}\n')
    assert load_outcomes(f"{tmp_path}:sft")[0] == f"{tmp_path}:sft"
    with pytest.raises(ConfigError, match=r"rl.jsonl:1: not an outcome row"):
        load_outcomes(str(tmp_path))  # the default label is the last stage: rl
    with pytest.raises(ConfigError, match=r"no evaluation 'best'; it has: rl, sft"):
        load_outcomes(f"{tmp_path}:best")
    (tmp_path / "eval/rl.jsonl").write_text("{oops\n")
    with pytest.raises(ConfigError, match=r"rl.jsonl:1: not JSON"):
        load_outcomes(f"{tmp_path}:rl")


# ---------------------------------------------------------------- task sets


def test_ood_templates_are_heldout_problems_in_new_words():
    heldout, ood = make_tasks("heldout", 200, 0, 2), make_tasks("ood_templates", 200, 0, 2)
    assert {t.split for t in ood} == {"ood_templates"}
    assert all(t.prompt.startswith("There are ") for t in ood)
    assert not any(t.prompt.startswith("There are ") for t in [
        *make_tasks("train", 500, 0, 2), *heldout])  # no other split words it that way
    # the same arithmetic is never a train problem: ood keys fall in the heldout hash split
    train_keys = {t.metadata["problem"].key() for t in make_tasks("train", 2000, 0, 2)}
    assert not train_keys & {t.metadata["problem"].key() for t in ood}
    assert not {t.id for t in heldout} & {t.id for t in ood}
    assert ENVS["calculator"].task_space("ood_templates", 2) == ENVS["calculator"].task_space(
        "heldout", 2)


@pytest.mark.slow
def test_eval_sets_and_seeds_write_every_outcome(tmp_path):
    cfg = load_config(CONFIG, [*TINY_RUN, "rl.steps=0", SETS, "eval.seeds=[0, 1]",
                               "eval.samples_per_task=2", "eval.pass_k=2"])
    summary = train(cfg, tmp_path)
    for name in ("heldout", "ood_difficulty", "ood_templates"):
        s = summary[f"{name}_after_sft"]
        assert (s["tasks"], s["samples"], s["seeds"]) == (6, 24, 2)
        assert s["success"] == pytest.approx((s["success/seed0"] + s["success/seed1"]) / 2)
        assert "pass@2" in s
    out = [json.loads(line) for line in (tmp_path / "eval/sft.jsonl").read_text().splitlines()]
    assert len(out) == 3 * 6 * 2 * 2
    assert {(r["set"], r["difficulty"]) for r in out} == {
        ("heldout", 2), ("ood_difficulty", 4), ("ood_templates", 2)}
    assert {r["seed"] for r in out} == {0, 1} and {r["sample"] for r in out} == {0, 1}
    assert set(out[0]) == {"set", "task_id", "seed", "sample", "success", "reward", "status",
                           "difficulty"}
    heldout = {r["task_id"] for r in out if r["set"] == "heldout"}
    assert heldout == {t.id for t in make_tasks("heldout", 6, 0, 2)}
    # the traces keep each set apart, under the phase its metrics are logged as
    with closing(connect(tmp_path / "traces.sqlite")) as con:
        phases = dict(con.execute("SELECT phase, COUNT(*) FROM episodes GROUP BY phase"))
    assert phases == {"eval_sft": 24, "eval_sft_ood_difficulty": 24,
                      "eval_sft_ood_templates": 24}


def test_eval_set_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"eval.sets: got names \['a', 'a'\]; expected at "
                                          "least one set, each name once"):
        load_config(CONFIG, ["eval.sets=[{name: a}, {name: a}]"])
    with pytest.raises(ConfigError, match=r"eval.seeds: got \[1, 1\]; each seed once"):
        load_config(CONFIG, ["eval.seeds=[1, 1]"])
    from tiller.preflight import check_task_counts

    cfg = load_config("configs/sql.yaml", ["eval.sets=[{name: x, split: ood_templates}]"])
    with pytest.raises(ConfigError, match=r"eval.sets \(x\).split: got 'ood_templates'; env "
                                          "sql offers: heldout"):
        check_task_counts(cfg, ENVS["sql"])
    cfg = load_config(CONFIG, ["eval.sets=[{name: x, tasks: 2000, difficulty: 1}]"])
    with pytest.raises(ConfigError, match=r"eval.sets \(x\).tasks: got 2000; env calculator "
                                          "has only"):
        check_task_counts(cfg, ENVS["calculator"])


def test_env_state_is_reset_between_episodes_on_sql():
    """One SqlEnv object reused for two expert episodes of the same task: the second starts
    from the seeded database, not from the first's changes, and both succeed."""
    tok = train_tokenizer([], 0)
    task = sql_tasks("heldout", 1, 0, 3)[0]
    env = SqlEnv()
    trajs = collect_expert(ENVS["sql"], [task, task], tok, guess=0.0,
                           limits=EpisodeLimits(5, 1 << 16), seed=0, make_env=lambda i: env)
    assert [t.reward.value for t in trajs] == [1.0, 1.0]

    async def dirty_then_reset():
        await env.reset(task, 0)
        await env.invoke(ToolCall("execute", {"sql": "DELETE FROM employees"}))
        await env.reset(task, 0)
        return snapshot(env.db)

    assert asyncio.run(dirty_then_reset()) == snapshot(build_db(task.metadata["db_seed"]))


# ---------------------------------------------------------------- the commands


@pytest.mark.slow
def test_eval_run_dir_and_compare(tmp_path):
    runner = CliRunner()
    run = tmp_path / "run"
    train(load_config(CONFIG, [*TINY_RUN, "rl.steps=0", "eval.tasks=6"]), run)
    run_config = (run / "config.yaml").read_text()
    r = runner.invoke(app, ["eval", str(run), "-o", str(tmp_path / "ev"), "eval.tasks=6"])
    assert r.exit_code == 0, r.output
    got = (tmp_path / "ev/eval/checkpoint.jsonl").read_text().splitlines()
    assert len(got) == 6 and json.loads((tmp_path / "ev/summary.json").read_text())["model"] \
        == str(run / "checkpoints/final")
    assert (run / "config.yaml").read_text() == run_config  # the run's own stays as it was
    # CONFIG --model: the same model, the same tasks and seeds: the same outcomes
    r = runner.invoke(app, ["eval", CONFIG, "--model", str(run / "checkpoints/final"),
                            "-o", str(tmp_path / "ev2"), *TINY_RUN, "eval.tasks=6"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "ev2/eval/checkpoint.jsonl").read_text().splitlines() == got
    # the default output folder is under the run
    r = runner.invoke(app, ["eval", str(run), "eval.tasks=6"])
    assert r.exit_code == 0, r.output
    assert len(list((run / "evals").glob("*/eval/checkpoint.jsonl"))) == 1
    r = runner.invoke(app, ["eval", str(run), "-o", str(tmp_path / "ev3"), "eval.tasks=6",
                            "eval.seeds=[3, 4]"])
    assert r.exit_code == 0 and "heldout per seed: seed3 " in r.output, r.output
    r = runner.invoke(app, ["compare", f"{run}:sft", str(tmp_path / "ev")])
    assert r.exit_code == 0, r.output
    assert "paired comparison on heldout (6 tasks)" in r.output and "McNemar" in r.output
    # other tasks (another seed draws other held-out tasks): refused in one line
    other = tmp_path / "other"
    train(load_config(CONFIG, [*TINY_RUN, "rl.steps=0", "eval.tasks=6", "seed=1"]), other)
    r = runner.invoke(app, ["compare", str(run), str(other)])
    assert r.exit_code == 2 and "different task lists" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_eval_errors_are_one_line(tmp_path):
    def line(*args) -> str:
        code, out = cli(*args)
        assert code == 2 and len(out.strip().splitlines()) == 1, out
        return out

    (tmp_path / "run").mkdir()
    assert "has no config.yaml" in line("eval", tmp_path / "run")
    (tmp_path / "run/config.yaml").write_text(Path(CONFIG).read_text())
    (tmp_path / "run/checkpoints/sft").mkdir(parents=True)
    out = line("eval", tmp_path / "run")
    assert "has no checkpoints/final" in out and "['sft']" in out
    assert "is not a model folder" in line("eval", CONFIG, "--model", tmp_path / "missing")
    assert "has no evaluations" in line("compare", tmp_path / "run", tmp_path / "run")


def test_a_set_without_tasks_has_eval_tasks():
    cfg = load_config(CONFIG, ["eval.tasks=12", "eval.sets=[{name: a}, {name: b, tasks: 5}]"])
    assert [(s.name, s.tasks) for s in cfg.eval.resolved_sets(2)] == [("a", 12), ("b", 5)]
