"""The three schedules (rl.mode) on real runs: staleness bound, ledger accounting, partial
rollouts, and async with max_staleness 0 reproducing sync."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from contextlib import closing

import pytest
import slow_loop
import torch
from helpers import RL_MOVES, rl_rows, tiny_rl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiller.config import load_config
from tiller.controller import rl
from tiller.engine.updates import WeightUpdate
from tiller.errors import ConfigError, RunError
from tiller.observe.steps import ledger_unaccounted
from tiller.observe.traces import connect
from tiller.rollout.manager import RolloutManager
from tiller.rollout.protocol import WindDown
from tiller.run import Run
from tiller.seeds import derive_seed
from tiller.train.shaping import train_reward

CONFIG = "configs/calculator.yaml"


def config(model_dir, *more):
    return load_config(CONFIG, tiny_rl(model_dir, "rl.steps=3", "rl.group_size=2", *more))


def slow_episodes(monkeypatch, prob, seconds, pattern=None):
    for key, value in (("prob", prob), ("slow_s", seconds), ("pattern", pattern),
                       ("started", 0)):
        monkeypatch.setitem(slow_loop.SLOW, key, value)
    return "agent.loop=slow_loop:run_episode"


def accounted(ledger):
    """Every started trajectory ended trained, filtered or dropped."""
    assert ledger["started"] > 0 and ledger_unaccounted(Counter(ledger)) == 0, ledger


def stop_after(step):
    """rl's after_step hook that stops RL after its first step, as an error would."""
    raise RunError(f"stopped after step {step}")


def final_row(run_dir, phase):
    """The one metrics.jsonl row of `phase` (rl_summary and traces are logged once, also when
    RL stopped with an error)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["phase"] == phase]
    return row


def final_ledger(run_dir):
    """The ledger rl_summary logged (`ledger/<bucket>`), as counts."""
    return Counter({k.removeprefix("ledger/"): int(v)
                    for k, v in final_row(run_dir, "rl_summary").items()
                    if k.startswith("ledger/")})


def coin_reward(t, *_):
    """A seeded 0/1 per episode: about half the groups of 2 are flat (equal rewards)."""
    return float(derive_seed(t.task_id, t.sample_index) % 2)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(0, 2), seed=st.integers(0, 10_000), slow_s=st.floats(0.05, 0.5),
       slow_prob=st.floats(0.1, 0.5), dynamic=st.booleans(), inflight=st.sampled_from([None, 4]))
def test_trained_staleness_never_exceeds_the_bound(calc_sft_dir, tmp_path_factory, monkeypatch,
                                                   k, seed, slow_s, slow_prob, dynamic,
                                                   inflight):
    """Over random episode latencies, with and without dynamic-sampling refills and an
    in-flight cap: no trained trajectory is staler than k, no run stalls (a batch wait longer
    than 60 s fails the example), and every episode is in the ledger."""
    out = tmp_path_factory.mktemp("stale")
    more = [f"rollout.max_inflight={inflight}"] if inflight else []
    if dynamic:
        monkeypatch.setattr("tiller.controller.train_reward", coin_reward)
        more.append("rl.algorithm.dynamic_sampling={enabled: true, max_rounds: 3}")
    cfg = config(calc_sft_dir, "rl.mode=async", f"rl.max_staleness={k}", "rl.steps=4",
                 f"seed={seed}", "rollout.batch_timeout_s=60",
                 slow_episodes(monkeypatch, slow_prob, slow_s), *more)
    summary = rl(Run(cfg, out))
    rows = rl_rows(out)
    assert len(rows) == 4
    assert all(r["staleness_max"] <= k for r in rows if not r["skipped"])
    assert summary["staleness_max"] <= k
    accounted(summary["ledger"])


def test_stale_groups_are_filtered_and_replaced(calc_sft_dir, tmp_path):
    """Groups that become staler than the bound while they wait are filtered, and their slots
    go to new groups (this is the filter behind the throttle, forced by a version jump)."""
    cfg = config(calc_sft_dir, "rl.mode=async", "rl.max_staleness=1", "rl.steps=2")
    run = Run(cfg, tmp_path)
    manager = manager_for(run)
    try:  # lag 1: two steps' worth of groups (4) start at once, sampled by v0
        deadline = time.monotonic() + 60
        while len(manager.buffer.ready) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(manager.buffer.ready) == 4 and manager.ledger["started"] == 8
        # the trainer jumped to v5 and the engine serves it: every ready group is 5 stale
        run.engine.update_weights(WeightUpdate.full(run.model, 5))
        manager.weights_live(0, 5)
        assert manager.ledger["filtered/stale"] == 8
        taken = manager.next_batch(0)  # fresh groups were started in their place
        assert len(taken.trajectories) == 4
        assert all(min(t.versions) == 5 for t in taken.trajectories)
    finally:
        ledger = manager.close()
    run.close()
    accounted(ledger)
    assert ledger["trained"] == 4 and ledger["started"] == 16


def manager_for(run, reward=None):
    cfg = run.cfg
    return RolloutManager(cfg, run.engine, run.sampling(1.0),
                          run.rl_tasks(),
                          episode_fn=run.episode_fn, make_env=run.make_env,
                          tokenizer=run.tokenizer, limits=run.limits,
                          reward=reward or (lambda t: train_reward(t, cfg.rl.algorithm,
                                                                   cfg.l_max, cfg.l_cache)),
                          version=run.trainer.version)


@pytest.mark.slow
@pytest.mark.parametrize("shutdown_s, buckets", [
    (30.0, {"dropped/in_flight_at_end": 4}),
    # the group's 3 fast episodes ended before it was cancelled: counted, not lost
    (0.2, {"dropped/in_flight_at_end": 3, "dropped/cancelled_at_end": 1})])
def test_the_ledger_accounts_for_episodes_in_flight_at_the_end(calc_sft_dir, tmp_path,
                                                             monkeypatch, shutdown_s, buckets):
    # The first group is fast; in the second, one episode waits 3 s. The run ends (here: the
    # manager closes after one batch, as when a run stops early) with it still running. With a
    # long shutdown window it reaches its turn, whose request is refused (it ends aborted);
    # with a short one it is cancelled while it waits.
    cfg = config(calc_sft_dir, "rl.mode=async", "rl.steps=2", "rl.tasks_per_step=1",
                 "rl.group_size=4", f"rollout.shutdown_timeout_s={shutdown_s}",
                 slow_episodes(monkeypatch, 0.0, 3.0, pattern=[False] * 7 + [True]))
    run = Run(cfg, tmp_path)
    manager = manager_for(run)
    try:
        taken = manager.next_batch(0)
    finally:
        ledger = manager.close()
        run.close()
    accounted(ledger)
    assert len(taken.trajectories) == 4 and ledger["trained"] == 4
    assert ledger["started"] == 8
    assert {k: v for k, v in ledger.items() if k.endswith("_at_end")} == buckets


@pytest.mark.slow
@pytest.mark.parametrize("mode, stop, shutdown_s, slow_s", [
    ("async", False, 30.0, 4.0),  # a run that finishes never samples past its last step
    # stopped after step 1, which trained 2 of the 6 groups started (the throttle allows 3
    # steps' worth); the slow episode is running, then ends in the wind-down
    ("async", True, 30.0, 4.0),
    ("async", True, 0.2, 20.0),  # ... or is cancelled there, its group's other episode ended
    ("one_step_off", True, 30.0, 4.0)])  # unit 1 was running beside step 1
def test_what_the_end_of_rl_leaves_is_traced_as_untrained(calc_sft_dir, tmp_path, monkeypatch,
                                                          mode, stop, shutdown_s, slow_s):
    """Every episode that ended is in traces.sqlite, those that ended after the last batch
    too. Those the end of RL left untrained (the ledger's dropped/in_flight_at_end and
    dropped/unused_at_end) have at_end = 1 and no trained_step; those cancelled while running
    have no trajectory and are counted in metrics.jsonl's final ledger."""
    cfg = config(calc_sft_dir, f"rl.mode={mode}", f"rollout.shutdown_timeout_s={shutdown_s}",
                 slow_episodes(monkeypatch, 0.0, slow_s, pattern=[False] * 7 + [True]))
    run = Run(cfg, tmp_path)

    try:
        if stop:
            with pytest.raises(RunError, match="stopped after step 1"):
                rl(run, after_step=stop_after)
        else:
            rl(run)
    finally:
        run.close()
    ledger, traces = final_ledger(tmp_path), final_row(tmp_path, "traces")
    accounted(ledger)
    with closing(connect(tmp_path / "traces.sqlite")) as con:
        n, trained, at_end, both = con.execute(
            "SELECT count(*), count(trained_step), total(at_end), "
            "total(at_end AND trained_step IS NOT NULL) FROM episodes WHERE phase = 'rl'"
        ).fetchone()
        steps = {s for (s,) in con.execute("SELECT DISTINCT rl_step FROM episodes "
                                           "WHERE phase = 'rl' AND at_end = 1")}
    cancelled = ledger["dropped/cancelled_at_end"]
    left = ledger["dropped/in_flight_at_end"] + ledger["dropped/unused_at_end"]
    assert n == ledger["started"] - cancelled  # every episode that ended was traced
    assert trained == ledger["trained"] and both == 0
    assert at_end == left == traces["traces/at_end"]
    if not stop:
        assert (ledger["trained"], left, cancelled) == (12, 0, 0)
        return
    assert ledger["trained"] == 4 and steps == {1}
    assert ledger["started"] == (12 if mode == "async" else 8)
    assert (left, cancelled) == ((ledger["started"] - 4 - 1, 1) if shutdown_s < 1
                                 else (ledger["started"] - 4, 0))


def test_a_group_being_judged_at_the_end_of_rl_is_counted_as_in_flight(calc_sft_dir, tmp_path,
                                                                        monkeypatch, caplog):
    """The judge runs in a worker thread; a group still being judged when the wind-down gives
    up waiting is cancelled: its episodes ended, so they count as dropped/in_flight_at_end and
    are traced at_end, not reported as a failed group."""
    monkeypatch.setitem(slow_loop.JUDGE, "calls", 0)
    cfg = config(calc_sft_dir, "rl.mode=async", "rollout.shutdown_timeout_s=0.2",
                 "rl.judge.fn=slow_loop:slow_judge")
    run = Run(cfg, tmp_path)

    try:
        with caplog.at_level(logging.ERROR, logger="tiller.rollout.manager"), \
                pytest.raises(RunError, match="stopped after step 1"):
            rl(run, after_step=stop_after)
    finally:
        run.close()
    ledger = final_ledger(tmp_path)
    accounted(ledger)
    assert ledger["dropped/run_error"] == 0 and ledger["dropped/in_flight_at_end"] >= 2
    assert not [r for r in caplog.records if "a group failed" in r.message]
    with closing(connect(tmp_path / "traces.sqlite")) as con:
        (at_end,) = con.execute("SELECT total(at_end) FROM episodes WHERE phase = 'rl'"
                                ).fetchone()
    assert at_end == ledger["dropped/in_flight_at_end"] + ledger["dropped/unused_at_end"]


@pytest.mark.slow
def test_the_wind_down_against_a_stuck_engine_ends_within_its_allowance(calc_sft_dir, tmp_path,
                                                                       caplog):
    """The engine hangs inside a forward (a stuck accelerator) with every episode waiting on
    it. close() aborts the live requests and waits for the episodes within one shared window,
    cancels them, and returns inside WindDown.allowance with every episode in the ledger. Each
    abort waited only until the window's end, so none is left to apply later. (Before, the
    aborts and the episodes each got a full window, then the cancelled ones 30 s more, while
    close allowed one window + 60 s: a stuck engine at the default 60 s outlived close.)

    Asserted on what happened, not on tight timings (a loaded machine delays every thread):
    the aborts' own deadlines, the events logged and the ledger; the clock only with margins
    of a whole window."""
    window = 3.0
    run = Run(config(calc_sft_dir, "rl.mode=async", f"rollout.shutdown_timeout_s={window}"),
              tmp_path)
    entered, release = threading.Event(), threading.Event()
    aborts: list[tuple[float, float | None]] = []  # (wall time of the call, its timeout_s)
    abort = run.engine.abort

    def stuck(*_):
        entered.set()
        release.wait(120)

    def recorded_abort(request_id, *, timeout_s=None):
        aborts.append((time.time(), timeout_s))
        return abort(request_id, timeout_s=timeout_s)

    run.engine.abort = recorded_abort
    handle = run.engine.model.register_forward_pre_hook(stuck)
    try:
        manager = manager_for(run)
        assert entered.wait(60), "no episode reached the engine"
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tiller.rollout.manager"):
            ledger = manager.close()
        elapsed = time.monotonic() - t0
        leftover = [op for op in run.engine._controls if not op.done.cancelled()]
    finally:
        release.set()
        handle.remove()
        run.close()
    accounted(ledger)
    groups = ledger["started"] // 2  # rl.group_size=2
    assert ledger["dropped/cancelled_at_end"] == ledger["started"] > 0
    # every abort waited only until the one deadline of the window (none got a window of its
    # own, none waited without a limit): the stuck engine held the first to the end
    assert aborts and all(0 < t <= window for _, t in aborts), aborts
    deadlines = [at + t for at, t in aborts]
    assert max(deadlines) - min(deadlines) < window / 2, aborts
    assert not leftover, "aborts were left queued in the engine after close"
    said = [(r.getMessage(), r.created) for r in caplog.records]  # a repeat counts twice
    # (whether the abort thread ended before its wait was given up, a second warning, is a
    # race at the deadline: not asserted)
    cancelled = [(m, at) for m, at in said if f"{groups} groups still running 3s" in m
                 and "were cancelled" in m]
    untried = [m for m, _ in said if "were not tried within rollout.shutdown_timeout_s" in m]
    assert len(cancelled) == len(untried) == 1, said
    assert f", {len(aborts)} aborts failed or timed out and " in untried[0], untried
    # the episodes were cancelled at the window's end, not a window later; close returned
    # within what it allows (window + grace + margin), after the stuck engine used the window
    assert min(deadlines) - 0.1 <= cancelled[0][1] < min(deadlines) + window / 2, aborts
    assert window - 0.1 <= elapsed < WindDown(window).allowance, elapsed


def test_an_error_on_the_rollout_thread_stops_the_run_with_that_error(calc_sft_dir, tmp_path):
    def broken(t, *_):
        raise KeyError("the reward function broke")

    run = Run(config(calc_sft_dir, "rl.mode=async"), tmp_path)
    manager = manager_for(run, reward=broken)
    try:
        with pytest.raises(KeyError, match="the reward function broke"):
            manager.next_batch(0)
    finally:
        ledger = manager.close()
        run.close()
    accounted(ledger)
    assert ledger["dropped/run_error"] >= 2


def test_one_step_off_trains_on_data_exactly_one_step_stale(calc_sft_dir, tmp_path):
    summary = rl(Run(config(calc_sft_dir, "rl.mode=one_step_off"), tmp_path))
    rows = rl_rows(tmp_path)
    # step 1 trains on unit 0 (sampled by v0 at v0); later units were sampled one step back
    assert [(r["staleness_mean"], r["staleness_max"]) for r in rows] == [(0, 0), (1, 1), (1, 1)]
    assert summary["mode"] == "one_step_off"
    accounted(summary["ledger"])
    assert summary["ledger"]["started"] == 3 * 2 * 2  # never samples past the last step


def test_async_with_max_staleness_0_gives_the_same_updates_as_sync(calc_sft_dir, tmp_path):
    weights, rows = [], []
    for mode in (["rl.mode=sync"], ["rl.mode=async", "rl.max_staleness=0"]):
        run = Run(config(calc_sft_dir, "rl.steps=2", "rl.group_size=4", *RL_MOVES, *mode),
                  tmp_path / mode[0])
        start = {k: v.clone() for k, v in run.model.state_dict().items()}
        try:
            rl(run)
        finally:
            run.close()
        weights.append({k: v.clone() for k, v in run.model.state_dict().items()})
        rows.append([(r["reward_mean"], r["loss"], r["rollout_tokens"])
                     for r in rl_rows(tmp_path / mode[0])])
    assert rows[0] == rows[1]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(start[k], weights[1][k]) for k in start)  # they trained


@pytest.mark.parametrize("partial", ["continue", "abort_resume"])
def test_partial_rollouts_keep_per_token_versions_and_lose_no_token(calc_model_dir, tmp_path,
                                                                    partial):
    # random weights: turns run to max_new_tokens, long enough for updates to land mid-turn
    cfg = config(calc_model_dir, "rl.mode=async", "rl.max_staleness=100",
                 f"rollout.partial={partial}", "sampling.max_new_tokens=96",
                 "env.max_episode_tokens=600", "env.max_turns=2")
    run = Run(cfg, tmp_path)
    before = run.engine.stats()["generated_tokens"]
    manager = manager_for(run)
    stop = threading.Event()
    in_flight = "abort" if partial == "abort_resume" else "continue"

    def push():  # new weights every 30 ms while the episodes run (the same values: the test
        version = 0  # is about versions and tokens, not learning)
        while not stop.is_set():
            version += 1
            run.engine.update_weights(WeightUpdate.full(run.model, version), in_flight=in_flight)
            manager.weights_live(0, 0)  # the trainer did not move: nothing is stale
            time.sleep(0.03)

    pusher = threading.Thread(target=push)
    pusher.start()
    try:
        taken = manager.next_batch(0)
    finally:
        stop.set()
        pusher.join(timeout=30)
        ledger = manager.close()
    accounted(ledger)
    ended = taken.ended
    for t in ended:
        gen = [v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m]
        assert len(gen) == t.num_generated and all(v >= 0 for v in gen)
        assert [v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if not m] == \
            [-1] * (len(t.token_ids) - t.num_generated)
        for (start, end), turn_version in zip(t.turn_spans, t.versions, strict=True):
            span = t.token_versions[start:end]
            assert list(span) == sorted(span) and turn_version == min(span, default=turn_version)
    spanning = [t for t in ended for s, e in t.turn_spans if len(set(t.token_versions[s:e])) > 1]
    assert spanning, "no turn spanned a weight update: the test did not test anything"
    resumed = taken.stats["resumed_turns"]
    assert (resumed > 0) if partial == "abort_resume" else (resumed == 0)
    # every token the engine sampled is in exactly one trajectory the ledger counted
    generated = run.engine.stats()["generated_tokens"] - before
    assert ledger["tokens/generated"] == generated
    run.close()


def test_mode_knobs_are_validated(calc_sft_dir):
    with pytest.raises(ConfigError, match=r"rl.max_staleness: got 2; it only applies with "
                                          r"rl.mode: async \(rl.mode is sync\)"):
        config(calc_sft_dir, "rl.max_staleness=2")
    with pytest.raises(ConfigError, match=r"rollout.max_inflight: got 8; it only applies"):
        config(calc_sft_dir, "rollout.max_inflight=8")
    with pytest.raises(ConfigError, match=r"rollout.max_inflight: got 1; expected at least "
                                          r"rl.group_size = 2"):
        config(calc_sft_dir, "rl.mode=async", "rollout.max_inflight=1")
    with pytest.raises(ConfigError, match=r"rollout.partial: got abort_resume; in rl.mode: "
                                          r"sync no episode runs while weights change"):
        config(calc_sft_dir, "rollout.partial=abort_resume")
    cfg = config(calc_sft_dir, "rl.mode=async", "rl.mini_batches=2")
    assert (cfg.rl.staleness_bound, cfg.rl.lag_steps) == (4, 2)  # versions, then steps
