"""rl.curriculum: the level moves toward the success band on synthetic success streams, filter
mode skips and counts, draws do not depend on the order groups finish in, bad configs are one
line, and real tiny RL runs (sync and async) log the curriculum's metrics."""

import json

import pytest
from helpers import tiny_rl

from tiller.config import ConfigError, load_config
from tiller.controller import rl
from tiller.envs import ENVS
from tiller.envs.dataset import DatasetEnv
from tiller.envs.verifiers import Reward
from tiller.preflight import check_task_counts
from tiller.rollout.curriculum import (
    DRAW,
    LEVEL,
    DifficultyCurriculum,
    FilterCurriculum,
    check_curriculum,
    group_success,
    make_curriculum,
)
from tiller.rollout.trajectory import Status, Trajectory
from tiller.run import Run

CONFIG = "configs/calculator.yaml"
CALC = ENVS["calculator"]


def config(*more):
    return load_config(CONFIG, ["model.build={}", "rl.steps=10", "rl.tasks_per_step=4",
                                "rl.curriculum.enabled=true", *more])


def group(successes, size=10, status=Status.COMPLETED):
    """A finished group: `successes` of `size` episodes succeeded."""
    return [Trajectory("t", k, (), (), (), 0, (), (), (), Reward(float(k < successes)), status)
            for k in range(size)]


def play(cur, rate_at, draws, order=lambda xs: xs):
    """Draw `draws` tasks in steps of 4 (every group of a step finishes before the next step
    draws, as in sync); a task at level L succeeds rate_at[L] of the time. Returns the level
    of each draw."""
    levels = []
    for _ in range(draws // 4):
        step = [next(cur) for _ in range(4)]
        levels += [t.metadata[LEVEL] for t in step]
        for t in order(step):
            cur.record(t, group(round(10 * rate_at[t.metadata[LEVEL]])))
    return levels


def test_difficulty_climbs_to_the_level_inside_the_band_and_stays():
    cur = make_curriculum(config("env.difficulty=4", "rl.curriculum.min_groups=4"), CALC, 200)
    assert isinstance(cur, DifficultyCurriculum) and cur.levels == [1, 2, 3, 4]
    levels = play(cur, {1: 0.9, 2: 0.8, 3: 0.5, 4: 0.1}, 40)
    # 4 groups per level decide: 1 (0.9 > 0.7) -> 2 (0.8) -> 3 (0.5: inside), then it stays
    assert levels == [1] * 4 + [2] * 4 + [3] * 32
    m = cur.metrics()
    assert m["curriculum/difficulty"] == 3 and m["curriculum/moves"] == 2
    assert (m["curriculum/estimate/1"], m["curriculum/estimate/2"]) == (0.9, 0.8)
    assert m["curriculum/estimate/3"] == 0.5 and "curriculum/estimate/4" not in m


def test_difficulty_steps_down_when_the_level_gets_too_hard():
    cur = make_curriculum(config("env.difficulty=3", "rl.curriculum.start=3",
                                 "rl.curriculum.min_groups=4"), CALC, 200)
    levels = play(cur, {1: 0.6, 2: 0.2, 3: 0.0}, 20)
    assert levels == [3] * 4 + [2] * 4 + [1] * 12  # 0.0 < 0.3, 0.2 < 0.3, then 0.6 holds


def test_the_top_level_is_the_target_and_the_estimate_is_a_window():
    cur = make_curriculum(config("env.difficulty=2", "rl.curriculum.min_groups=4",
                                 "rl.curriculum.window=4"), CALC, 200)
    assert play(cur, {1: 1.0, 2: 0.9}, 16) == [1] * 4 + [2] * 12  # never past env.difficulty
    # the window keeps the last 4 groups: four at 0.0 replace the 0.9s entirely
    assert play(cur, {1: 1.0, 2: 0.0}, 4) == [2] * 4
    assert cur.metrics()["curriculum/estimate/2"] == 0.0
    assert next(cur).metadata[LEVEL] == 1


def test_a_level_re_entered_is_judged_on_its_groups_since_then():
    cur = make_curriculum(config("env.difficulty=2", "rl.curriculum.start=2",
                                 "rl.curriculum.min_groups=4", "rl.curriculum.window=8"),
                          CALC, 200)
    assert play(cur, {1: 0.9, 2: 0.0}, 8) == [2] * 4 + [1] * 4  # down, then back up
    # level 2 now succeeds half the time: inside the band. Its four 0.0 groups from before it
    # was left are still in the window; counting them (0.25 < 0.3) would send it down again
    assert play(cur, {1: 0.9, 2: 0.5}, 12) == [2] * 12
    assert cur.metrics()["curriculum/estimate/2"] == 0.5  # the window of 8 holds only new ones


def test_draws_do_not_depend_on_the_order_groups_finish_in():
    rates = {1: 0.8, 2: 0.6, 3: 0.2}
    runs = [make_curriculum(config("env.difficulty=3", "rl.curriculum.min_groups=3",
                                   "rl.curriculum.window=3"), CALC, 200) for _ in range(2)]
    a = play(runs[0], rates, 40)
    b = play(runs[1], rates, 40, order=lambda xs: xs[::-1])
    assert a == b and runs[0].metrics() == runs[1].metrics()
    assert len(set(a)) > 1 and next(runs[0]).id == next(runs[1]).id


def test_env_errors_and_aborts_say_nothing_about_difficulty():
    assert group_success(group(3, size=4)) == 0.75
    assert group_success(group(0, size=4, status=Status.ENV_ERROR)) is None
    cur = make_curriculum(config("env.difficulty=2", "rl.curriculum.min_groups=1"), CALC, 20)
    task = next(cur)
    cur.record(task, group(0, size=4, status=Status.ABORTED))
    assert "curriculum/estimate/1" not in cur.metrics() and next(cur).metadata[LEVEL] == 1


def test_filter_skips_tasks_outside_the_band_counts_them_and_redraws_them():
    cur = make_curriculum(config("rl.curriculum.mode=filter", "rl.curriculum.pool=6",
                                 "rl.curriculum.max_skips=1", "rl.curriculum.min_groups=1"),
                          CALC, 0)
    assert isinstance(cur, FilterCurriculum) and len(cur.pool) == 6
    first = [next(cur) for _ in range(6)]  # one pass, nothing estimated yet: nothing skipped
    assert sorted(t.id for t in first) == sorted(t.id for t in cur.pool)
    easy, hard, fine = first[:2], first[2:4], first[4:]
    for t in easy:
        cur.record(t, group(10))  # 1.0 > 0.7
    for t in hard:
        cur.record(t, group(1))  # 0.1 < 0.3
    for t in fine:
        cur.record(t, group(5))
    assert cur.metrics()["curriculum/pool_in_band"] == pytest.approx(2 / 6)
    # the next pass yields only the two tasks inside the band, skipping the 4 others
    second = [next(cur) for _ in range(2)]
    assert {t.id for t in second} == {t.id for t in fine}
    m2 = cur.metrics()
    assert m2["curriculum/pool_too_easy"] == m2["curriculum/pool_too_hard"] == 2 / 6
    # a task skipped max_skips=1 draw in a row is drawn the pass after: its estimate may move;
    # the 6 draws finish pass 2 (skipping what is left of the 4) and draw all of pass 3
    third = [next(cur) for _ in range(6)]
    assert sorted(t.id for t in third) == sorted(t.id for t in cur.pool)
    m3 = cur.metrics()
    skips = m2["curriculum/skipped"] + m3["curriculum/skipped"]
    assert skips == m3["curriculum/skipped_total"] == 4
    assert [t.metadata[DRAW] for t in third] == list(range(8, 14))


@pytest.mark.parametrize("override, message", [
    ("rl.curriculum.band=[0.7, 0.3]", "rl.curriculum.band: got [0.7, 0.3]; expected [low, "
     "high] with 0 <= low < high <= 1"),
    ("rl.curriculum.band=[0.3, 1.5]", "rl.curriculum.band: got [0.3, 1.5]"),
    ("rl.curriculum.pool=10", "rl.curriculum.pool: got 10; it only applies with "
     "rl.curriculum.mode: filter (rl.curriculum.mode is difficulty)"),
    ("rl.curriculum.start=5", "rl.curriculum.start: got 5; expected at most env.difficulty = 2"),
    ("rl.curriculum.mode=sometimes", "rl.curriculum.mode: got 'sometimes'"),
    ("rl.curriculum.min_groups=9", "rl.curriculum.min_groups: got 9; expected at most "
     "rl.curriculum.window = 8"),
    ("rl.curriculum.min_level=2", "rl.curriculum.mode: got 'difficulty' with a single level "
     "(rl.curriculum.min_level 2 = env.difficulty), so there is nothing to adapt"),
    ("env.difficulty=1", "rl.curriculum.mode: got 'difficulty' with a single level "
     "(rl.curriculum.min_level 1 = env.difficulty)"),
])
def test_a_bad_curriculum_config_is_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        config(override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_level_too_small_for_the_run_fails_before_any_work():
    # difficulty 1 holds 89² one-operation problems, 80% of them train: 6336 < 1000 x 16
    cfg = config("rl.steps=1000", "rl.tasks_per_step=16")
    with pytest.raises(ConfigError, match=r"rl.curriculum.min_level: got 1; env calculator has "
                       r"only 63\d\d train tasks at difficulty 1 and the run may draw 16000"):
        check_task_counts(cfg, CALC)
    check_task_counts(config("rl.steps=1000", "rl.tasks_per_step=16", "env.difficulty=3",
                             "rl.curriculum.min_level=2"), CALC)


def test_a_difficulty_curriculum_on_an_env_without_difficulty_is_one_line():
    with pytest.raises(ConfigError) as e:  # refused before the env's rows are touched
        check_curriculum(config(), DatasetEnv, 40)
    assert str(e.value) == (
        "config field rl.curriculum.mode: got 'difficulty'; env dataset makes the same tasks "
        "at every difficulty, so there is no level to adapt: expected rl.curriculum.mode: filter")
    # a single level is fine with the curriculum off, and filter mode needs no levels
    config("env.difficulty=1", "rl.curriculum.enabled=false")
    config("env.difficulty=1", "rl.curriculum.mode=filter")


# ------------------------------------------------------------------ checkpoint state
def resumed(cur, cfg, tasks_per_level=200):
    """A curriculum built for the same config with `cur`'s state put back, through JSON (as
    a checkpoint's state.json carries it)."""
    state = json.loads(json.dumps(cur.state()))
    fresh = make_curriculum(cfg, CALC, tasks_per_level)
    fresh.load_state(state, "--resume: checkpoint step-000003")
    return fresh, state


def test_difficulty_state_round_trips_and_the_resumed_curriculum_draws_the_same():
    cfg = config("env.difficulty=3", "rl.curriculum.min_groups=2", "rl.curriculum.window=4")
    cur = make_curriculum(cfg, CALC, 200)
    # 4 groups at level 1 (0.9: too easy) move it up; 8 at level 2 (0.5) keep it there
    assert play(cur, {1: 0.9, 2: 0.5, 3: 0.1}, 12) == [1] * 4 + [2] * 8
    cur.metrics()  # the step's row read its counters
    fresh, state = resumed(cur, cfg)
    assert (state["draws"], state["level"], state["entered"], state["moves"]) == (12, 2, 4, 1)
    assert state["skipped"] == state["skipped_logged"] == 0
    # the window of 4 per level, by draw number
    assert state["estimates"] == [[1, [[0, 0.9], [1, 0.9], [2, 0.9], [3, 0.9]]],
                                  [2, [[8, 0.5], [9, 0.5], [10, 0.5], [11, 0.5]]]]
    made = {level: [t.id for t in CALC.make_tasks("train", 200, cfg.seed + 3, level)]
            for level in (1, 2)}
    assert state["taken"] == [[1, made[1][:4]], [2, made[2][:8]]]
    assert fresh.state() == state and fresh.metrics() == cur.metrics()
    # both go on alike: level 2 turns easy (0.9), so both move up to 3, with the same tasks
    rates = {1: 0.9, 2: 0.9, 3: 0.5}
    assert play(fresh, rates, 8) == play(cur, rates, 8) == [2] * 4 + [3] * 4
    a, b = next(cur), next(fresh)
    assert (a.id, a.metadata) == (b.id, b.metadata) == (a.id, {**a.metadata, DRAW: 20})
    assert fresh.state() == cur.state() and fresh.metrics() == cur.metrics()
    # a checkpoint holding groups open (one_step_off, async) leaves their results out: the
    # resumed run samples them again and records them anew
    assert cur.state(frozenset({18, 19}))["estimates"][2] == [3, [[16, 0.5], [17, 0.5]]]


def test_filter_state_round_trips_with_its_generator_order_and_skips():
    cfg = config("rl.curriculum.mode=filter", "rl.curriculum.pool=6",
                 "rl.curriculum.max_skips=2", "rl.curriculum.min_groups=1")
    cur = make_curriculum(cfg, CALC, 0)
    first = [next(cur) for _ in range(6)]
    for t, k in zip(first, [10, 10, 1, 1, 5, 5], strict=True):  # 2 easy, 2 hard, 2 fine
        cur.record(t, group(k))
    second = [next(cur) for _ in range(1)]  # the next pass started: 5 of 6 left to draw
    assert second[0].id in {t.id for t in first[4:]}
    fresh, state = resumed(cur, cfg)
    assert state["draws"] == 7 and state["skipped"] == len(state["skips"]) > 0
    assert len(state["order"]) + 1 + state["skipped"] == 6
    assert set(state["skips"].values()) == {1}
    assert state["rng"][0] == 3 and len(state["rng"][1]) == 625
    assert fresh.state() == state
    for t in first:  # one more result for each: both hear the same
        for c in (cur, fresh):
            c.record(t, group(5))
    ahead = [[(t.id, t.metadata[DRAW]) for t in (next(c) for _ in range(14))]
             for c in (cur, fresh)]
    assert ahead[0] == ahead[1] and cur.state() == fresh.state()
    assert cur.metrics() == fresh.metrics()


def test_a_checkpoints_curriculum_state_the_env_no_longer_makes_is_one_line():
    cfg = config("env.difficulty=3", "rl.curriculum.min_groups=2")
    cur = make_curriculum(cfg, CALC, 200)
    play(cur, {1: 0.9, 2: 0.5, 3: 0.1}, 8)
    state = cur.state()
    state["taken"][1][1][0] = "calculator-elsewhere"  # level 2's first task is another one
    with pytest.raises(ConfigError) as e:
        make_curriculum(cfg, CALC, 200).load_state(state, "--resume: checkpoint step-000002")
    assert str(e.value) == (
        "--resume: checkpoint step-000002: config field rl.steps is 10: the env's first 4 "
        "train tasks at curriculum level 2 are not those the checkpoint drew there "
        "(make_tasks gives other first tasks for this config's task count); resume with the "
        "run's rl.steps")
    cfg = config("rl.curriculum.mode=filter", "rl.curriculum.pool=6")
    cur = make_curriculum(cfg, CALC, 0)
    next(cur)
    state = cur.state()
    state["order"][2] = "calculator-elsewhere"
    with pytest.raises(ConfigError) as e:
        make_curriculum(cfg, CALC, 0).load_state(state, "--resume: checkpoint step-000001")
    assert str(e.value) == (
        "--resume: checkpoint step-000001: the curriculum's pool (rl.curriculum.pool 6 tasks "
        "of env calculator) no longer holds task 'calculator-elsewhere' the checkpoint's pass "
        "was to draw: the env's make_tasks changed; resume with the env the run used")


# ------------------------------------------------------------------ real runs
def tiny(sft_dir, *more):
    return load_config(CONFIG, tiny_rl(sft_dir, "rl.steps=3", "rl.curriculum.enabled=true",
                                       *more))


def rl_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl"]


def test_a_real_sync_run_moves_down_and_logs_every_step(calc_sft_dir, tmp_path):
    # the one-step-SFT model never succeeds: level 2's estimate is 0 < 0.3 after its first
    # step's 2 groups, so step 2 draws at level 1 (the lowest), where it stays
    cfg = tiny(calc_sft_dir, "env.difficulty=3", "rl.curriculum.start=2",
               "rl.curriculum.min_groups=2")
    summary = rl(Run(cfg, tmp_path))
    rows = rl_rows(tmp_path)
    assert [r["curriculum/difficulty"] for r in rows] == [2, 1, 1]
    assert [r["curriculum/moves"] for r in rows] == [0, 1, 1]
    assert rows[0]["curriculum/estimate/2"] == 0.0 and rows[-1]["curriculum/estimate/1"] == 0.0
    assert all(r["curriculum/skipped"] == 0 for r in rows)
    assert summary["ledger"]["started"] == 3 * 2 * 4


def test_a_real_sync_filter_run_counts_its_skips(calc_sft_dir, tmp_path):
    # pool 4 = the first 2 steps' tasks; all fail (0 < 0.3), so step 3's two draws pass over
    # all 4 once (max_skips 1) before drawing: 4 skips, counted at step 3
    cfg = tiny(calc_sft_dir, "rl.curriculum.mode=filter", "rl.curriculum.pool=4",
               "rl.curriculum.max_skips=1", "rl.curriculum.min_groups=1")
    rl(Run(cfg, tmp_path))
    rows = rl_rows(tmp_path)
    assert [r["curriculum/skipped"] for r in rows] == [0, 0, 4]
    assert rows[-1]["curriculum/skipped_total"] == 4
    assert rows[-1]["curriculum/pool_too_hard"] == 1.0


def test_a_real_async_run_feeds_the_curriculum_from_finished_groups(calc_sft_dir, tmp_path):
    cfg = tiny(calc_sft_dir, "rl.mode=async", "rl.max_staleness=1", "env.difficulty=3",
               "rl.curriculum.start=3", "rl.curriculum.min_groups=1")
    summary = rl(Run(cfg, tmp_path))
    rows = rl_rows(tmp_path)
    assert len(rows) == 3 and all("curriculum/difficulty" in r for r in rows)
    assert rows[-1]["curriculum/estimate/3"] == 0.0
    assert rows[-1]["curriculum/difficulty"] < 3  # it heard the failures and stepped down
    assert summary.get("ledger_unaccounted") is None
