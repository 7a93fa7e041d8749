"""traces.sqlite: exact episodes (tokens, masks, logprobs, tool calls), the trainer's arrays,
sampling, the size cap, a full queue, loud failures, a run's traces on vs off, and a run killed
with SIGKILL mid-step."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN, numbers, traces_of_version

from tiller.config import ConfigError, RLConfig, load_config
from tiller.controller import train
from tiller.engine.api import SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.envs.calculator import CalculatorEnv as Calc
from tiller.envs.verifiers import Reward
from tiller.errors import RunError, RunFolderError
from tiller.models import load_model
from tiller.observe.traces import TraceWriter, connect, decode, query, read_episode
from tiller.rollout.agent_loop import EngineActor, EpisodeLimits, ExpertActor, run_episode
from tiller.rollout.collect import collect, run_one
from tiller.rollout.trajectory import Status, TrajectoryBuilder
from tiller.run import Run
from tiller.tools.stack import ToolStack
from tiller.train.batch import Batch
from tiller.train.trainer import PolicyTrainer, RLStepTensors

RUN = [*TINY_RUN, "logging.tensorboard=false"]


def engine_episodes(model, tokenizer, limits, tasks=3, samples=2):
    """The tiny model's own episodes through the real engine and loop (real logprobs, token
    versions, seeds stamped by `run_one`)."""
    engine = EmbeddedEngine(model, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=(tokenizer.eos_token_id,))
    try:
        return asyncio.run(collect(
            Calc.make_tasks("train", tasks, 0, 2), samples, EngineActor(engine, params),
            episode_fn=run_episode, make_env=lambda *key: Calc(), tokenizer=tokenizer,
            limits=limits, seed=0, tag=("rl", 0)))
    finally:
        engine.close()


@pytest.fixture(scope="module")
def rl_episodes(calc_model_dir, tokenizer):
    """Six engine episodes (three tasks, two samples each), shared by the tests that only
    read them."""
    return engine_episodes(load_model(calc_model_dir), tokenizer,
                           EpisodeLimits(max_turns=6, max_episode_tokens=512))


def expert_episodes(tokenizer, limits, n=4):
    """The scripted expert's episodes: each calls the calculator tool, half guess wrong."""
    tasks = Calc.make_tasks("heldout", n, 0, 2)

    async def go():
        return await asyncio.gather(*(
            run_one(t, 0, ExpertActor(Calc, t, tokenizer, guess_prob=0.5 * (i % 2)),
                    episode_fn=run_episode, make_env=lambda *key: Calc(), tokenizer=tokenizer,
                    limits=limits, seed=0, tag=("eval", "sft"))
            for i, t in enumerate(tasks)))
    return asyncio.run(go())


def test_rows_hold_the_trajectories_exactly(rl_episodes, tokenizer, limits, tmp_path):
    rl, ev = rl_episodes, expert_episodes(tokenizer, limits)
    assert sum(t.tool_calls for t in ev) >= len(ev)  # the expert calls the tool
    writer = TraceWriter(tmp_path / "traces.sqlite")
    for t in rl:
        writer.put_episode(t, "rl", "train", global_step=3, rl_step=1)
    for t in ev:
        writer.put_episode(t, "eval_sft", "heldout", global_step=3)
    stats = writer.close()
    assert stats["traces/written"] == len(rl) + len(ev) and stats["traces/queued"] == 0
    assert stats["traces/writer_cpu_s"] > 0
    con = connect(tmp_path / "traces.sqlite")
    ids = [r["id"] for r in con.execute("SELECT id FROM episodes ORDER BY id")]
    assert len(ids) == len(rl) + len(ev)
    for episode_id, t in zip(ids, rl + ev, strict=True):
        row = read_episode(con, episode_id)
        assert row["token_ids"] == list(t.token_ids)
        assert row["loss_mask"] == list(t.loss_mask)
        assert row["logprobs"] == list(t.logprobs)  # float64: exact
        assert row["token_versions"] == list(t.token_versions)
        assert row["turn_spans"] == [list(s) for s in t.turn_spans]
        assert row["messages"] == json.loads(json.dumps(list(t.messages)))
        assert (row["reward"], row["checks"]) == (t.reward.value, dict(t.reward.checks))
        assert (row["task_id"], row["sample_index"], row["seed"], row["status"]) == (
            t.task_id, t.sample_index, t.seed, t.status.value)
        assert (row["draw"], row["tag"]) == (t.draw, list(t.tag)) != (0, [])  # run_one's tag
        assert row["n_generated"] == t.num_generated and row["prompt_len"] == t.prompt_len
        assert row["timings"] == dict(t.timings) and row["trained_step"] is None
        calls = row["tool_calls_list"]
        assert len(calls) == t.tool_calls == len(t.tool_results)
        for c, (turn, r) in zip(calls, t.tool_results, strict=True):
            assert (c["turn"], c["name"], c["arguments"], c["result"], c["outcome"]) == (
                turn, r.call.name, r.call.arguments, r.content, r.outcome.value)
            assert c["latency_s"] == r.latency_s > 0
    assert any(sum(t.logprobs) != 0 for t in rl)  # the engine's logprobs, not zeros
    # the reader's filters and pages
    assert [r["id"] for r in query(con, phase="eval_sft")] == ids[len(rl):]
    page = query(con, phase="rl", order_by="reward", descending=True, limit=2, offset=2)
    assert len(page) == 2 and "token_ids" not in page[0] and "messages" not in page[0]
    assert query(con, status="completed", split="heldout", min_reward=1.0) == query(
        con, phase="eval_sft", min_reward=1.0)
    assert read_episode(con, 10_000) is None
    # plain sqlite3 sees the per-check breakdown with its JSON functions
    (n,) = con.execute("SELECT count(*) FROM episodes WHERE phase = 'eval_sft' AND "
                       "json_extract(checks, '$.correct') = 1").fetchone()
    assert n == sum(t.reward.checks["correct"] == 1 for t in ev)


def test_the_trainer_arrays_are_what_the_trainer_computed(rl_episodes, model, tokenizer,
                                                          tmp_path):
    trajs = rl_episodes
    writer = TraceWriter(tmp_path / "traces.sqlite")
    for t in trajs:
        writer.put_episode(t, "rl", "train", global_step=0, rl_step=1)
    trainer = PolicyTrainer(model)
    trainer.set_optimizer(1e-4)
    batch = Batch.collate(trajs, tokenizer.pad_token_id, rewards=[0, 1, 1, 0, 0.5, 0],
                          group_index=[0, 0, 1, 1, 2, 2])
    trainer.rl_step(batch, RLConfig(mini_batches=2), l_max=256)  # two updates: a prepass
    writer.put_training(1, trajs, batch, trainer.last_rl)
    assert writer.close()["traces/trained"] == len(trajs)
    logp, adv = trainer.last_rl
    assert adv.abs().sum() > 0 and logp.abs().sum() > 0
    con = connect(tmp_path / "traces.sqlite")
    for i, (row, t) in enumerate(zip(con.execute("SELECT * FROM episodes ORDER BY id"), trajs,
                                     strict=True)):
        n = len(t.token_ids)
        assert row["trained_step"] == 1
        stored = decode("trainer_logprobs", row["trainer_logprobs"])
        assert stored == logp[i, :n].tolist()
        assert decode("advantages", row["advantages"]) == adv[i, :n].tolist()
        assert decode("train_mask", row["train_mask"]) == [int(m) for m in t.loss_mask]
        # the output layer runs on the loss positions only: 0 off the train mask, and only there
        assert [v != 0 for v in stored] == [bool(m) for m in t.loss_mask]


def test_a_split_episode_gets_its_rows_back_end_to_end(tmp_path):
    """Two exact sequences, two batch rows: the stored arrays are the rows [:length] laid end
    to end, so they line up with the flat token ids."""
    b = TrajectoryBuilder("t")
    b.append_prompt([1, 2, 3])
    b.append_generated([4, 5], [-0.1, -0.2], 0)
    b.append_observation([6])
    b.start_segment([7, 8], "memory_dropped")
    b.append_generated([9], [-0.3], 0)
    other = TrajectoryBuilder("u")
    other.append_prompt([1])
    other.append_generated([2, 3], [-0.4, -0.5], 0)
    trajs = [replace(x.finish(Reward(1.0), Status.COMPLETED), seed=k)
             for k, x in enumerate((b, other))]
    batch = Batch.collate(trajs, 0)
    assert batch.episode_index.tolist() == [0, 0, 1]
    marks = torch.arange(3)[:, None] * 100.0 + torch.arange(batch.input_ids.size(1))  # row, pos
    writer = TraceWriter(tmp_path / "traces.sqlite")
    for t in trajs:
        writer.put_episode(t, "rl", "train", 0, 1)
    writer.put_training(1, trajs, batch, RLStepTensors(marks, -marks))
    writer.close()
    first, second = (read_episode(tmp_path / "traces.sqlite", i) for i in (1, 2))
    assert first["segment_starts"] == [6] and first["split_reasons"] == ["memory_dropped"]
    assert first["trainer_logprobs"] == [0, 1, 2, 3, 4, 5, 100, 101, 102]
    assert first["advantages"] == [-v for v in first["trainer_logprobs"]]
    assert first["train_mask"] == list(trajs[0].loss_mask) == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert second["trainer_logprobs"] == [200, 201, 202]


def short_episode(task_id):
    """Two prompt tokens and two generated ones, rewarded 1, with no seed."""
    b = TrajectoryBuilder(task_id)
    b.append_prompt([1, 2])
    b.append_generated([3, 4], [-0.1, -0.2], 0)
    return b.finish(Reward(1.0), Status.COMPLETED)


def test_a_second_run_into_the_same_file_updates_only_its_own_rows(tmp_path):
    """The same seed gives the same episode seeds: a rerun's trainer arrays and at_end marks
    go to the rows its writer wrote, not to the earlier run's with equal seeds."""
    traj = replace(short_episode("t"), seed=7)
    batch = Batch.collate([traj], 0)
    marks = torch.ones_like(batch.input_ids, dtype=torch.float32)
    db = tmp_path / "traces.sqlite"
    for run, value in ((1, 1.0), (2, 2.0)):
        writer = TraceWriter(db)
        writer.put_episode(traj, "rl", "train", 0, 1)
        writer.put_training(run, [traj], batch, RLStepTensors(marks * value, marks * value))
        if run == 2:
            writer.put_at_end(1, [traj])
        stats = writer.close()
        assert stats["traces/trained"] == 1 and stats["traces/at_end"] == (run == 2)
    first, second = (read_episode(db, i) for i in (1, 2))
    assert first["trained_step"] == 1 and first["advantages"] == [1.0] * 4
    assert first["at_end"] == 0
    assert second["trained_step"] == 2 and second["advantages"] == [2.0] * 4
    assert second["at_end"] == 1


def test_seedless_episodes_are_written_and_never_given_anothers_arrays(tmp_path):
    trajs = [short_episode("t"), short_episode("u")]  # seed None: not collected by a run
    assert [t.seed for t in trajs] == [None, None]
    batch = Batch.collate(trajs[:1], 0)
    writer = TraceWriter(tmp_path / "traces.sqlite")
    for t in trajs:
        writer.put_episode(t, "rl", "train", 0, 1)
    ones = torch.ones_like(batch.input_ids, dtype=torch.float32)
    writer.put_training(1, trajs[:1], batch, RLStepTensors(ones, ones))
    stats = writer.close()
    assert stats["traces/written"] == 2 and stats["traces/trained"] == 0
    assert [read_episode(tmp_path / "traces.sqlite", i)["trained_step"] for i in (1, 2)] \
        == [None, None]


def test_the_schema_splits_into_complete_statements():
    from tiller.observe.traces import SCHEMA

    pieces = [p for p in SCHEMA.split(";") if p.strip()]
    assert len(pieces) >= 10 and all(sqlite3.complete_statement(p + ";") for p in pieces)
    # a semicolon inside a statement would leave an incomplete piece
    assert not sqlite3.complete_statement("CREATE TABLE t (a TEXT DEFAULT 'x")


def test_a_run_that_cannot_open_its_traces_closes_what_it_started(calc_sft_dir, tmp_path,
                                                                 monkeypatch):
    closed = []

    def spy(cls):
        real = cls.close

        def close(self):
            closed.append(cls.__name__)
            real(self)
        return close

    for cls in (EmbeddedEngine, ToolStack):
        monkeypatch.setattr(cls, "close", spy(cls))
    traces_of_version(tmp_path / "traces.sqlite", 1)
    cfg = load_config("configs/calculator.yaml", [f"model.path={calc_sft_dir}",
                                                  "model.build=null"])
    with pytest.raises(RunError, match="holds traces of schema version 1"):
        Run(cfg, tmp_path)
    # the trace writer opens before the engine (the engine closes before it): no engine
    # started, the tool stack closed
    assert closed == ["ToolStack"]


def test_sample_rate_keeps_every_eval_episode_and_a_seeded_half_of_rl(rl_episodes, tmp_path):
    t = rl_episodes[0]
    kept = []
    for run in ("a", "b"):
        writer = TraceWriter(tmp_path / f"{run}.sqlite", sample_rate=0.5, seed=0)
        for seed in range(1000):
            writer.put_episode(replace(t, seed=seed), "rl", "train", 0, 1)
        for seed in range(20):
            writer.put_episode(replace(t, seed=seed), "eval_rl", "heldout", 0)
        stats = writer.close()
        con = connect(tmp_path / f"{run}.sqlite")
        kept.append([s for (s,) in con.execute("SELECT seed FROM episodes WHERE phase = 'rl'")])
        assert con.execute("SELECT count(*) FROM episodes WHERE phase = 'eval_rl'").fetchone()[
            0] == 20
    assert kept[0] == kept[1]  # a hash of the seed decides: the same episodes every time
    assert len(kept[0]) == 518  # about half (binomial sd 16)
    assert stats["traces/sampled_out"] == 1000 - 518 and stats["traces/written"] == 518 + 20


def test_the_size_cap_stops_rl_episodes_never_eval_ones(rl_episodes, tmp_path):
    trajs = rl_episodes
    probe = TraceWriter(tmp_path / "probe.sqlite")
    probe.put_episode(trajs[0], "rl", "train", 0, 1)
    one_mb = probe.close()["traces/payload_mb"]
    writer = TraceWriter(tmp_path / "traces.sqlite", max_mb=2.5 * one_mb)
    for k in range(10):
        writer.put_episode(replace(trajs[0], seed=k), "rl", "train", 0, 1)
    for k in range(3):
        writer.put_episode(replace(trajs[0], seed=100 + k), "eval_rl", "heldout", 0)
    stats = writer.close()
    assert stats["traces/written"] == 2 + 3 and stats["traces/dropped_cap"] == 8
    assert stats["traces/eval_over_cap"] == 3
    con = connect(tmp_path / "traces.sqlite")
    assert [p for (p,) in con.execute("SELECT phase FROM episodes ORDER BY id")] == ["rl"] * 2 + [
        "eval_rl"] * 3


def test_the_size_cap_counts_what_the_file_already_holds(rl_episodes, tmp_path):
    """A resumed run's writer opens the file its killed run wrote: observe.traces.max_mb caps
    the file, so what it holds counts from the start (not from zero again)."""
    db = tmp_path / "traces.sqlite"
    first = TraceWriter(db)
    for k in range(2):
        first.put_episode(replace(rl_episodes[0], seed=k), "rl", "train", 0, 1)
    held = first.close()["traces/payload_mb"]
    writer = TraceWriter(db, max_mb=1.25 * held)  # room for half an episode more
    assert writer.stats()["traces/payload_mb"] == pytest.approx(held)
    writer.put_episode(replace(rl_episodes[0], seed=2), "rl", "train", 0, 2)
    stats = writer.close()
    assert stats["traces/written"] == 0 and stats["traces/dropped_cap"] == 1
    assert connect(db).execute("SELECT count(*) FROM episodes").fetchone()[0] == 2


class BatchSeen(TraceWriter):
    """A TraceWriter that tells when its writer thread has fixed its first batch (it then
    writes it: with the file locked, it waits on the lock holding that batch alone)."""

    def __init__(self, *args, **kwargs):
        self.batch_fixed = threading.Event()
        super().__init__(*args, **kwargs)

    def _write_batch(self, con, items):
        self.batch_fixed.set()
        super()._write_batch(con, items)


def test_a_full_queue_drops_and_counts_rl_items_and_never_waits(rl_episodes, tmp_path):
    t = rl_episodes[0]
    path = tmp_path / "traces.sqlite"
    writer = BatchSeen(path, queue_size=2)
    blocker = sqlite3.connect(path)
    blocker.execute("BEGIN EXCLUSIVE")  # the writer waits on the lock (sqlite's 5 s timeout)
    writer.put_episode(replace(t, seed=0), "rl", "train", 0, 1)
    assert writer.batch_fixed.wait(4.0), "the writer never took the first episode"
    t0 = time.perf_counter()
    for k in range(1, 50):
        writer.put_episode(replace(t, seed=k), "rl", "train", 0, 1)
    writer.put_ledger(1, 1, {"started": 50.0})
    assert time.perf_counter() - t0 < 1.0  # training never waited
    blocker.rollback()
    blocker.close()
    stats = writer.close()
    assert stats["traces/written"] + stats["traces/dropped_queue"] == 51 - stats["traces/steps"]
    assert stats["traces/dropped_queue"] == 51 - 3  # one taken, two queued, the rest dropped


def test_a_failing_writer_stops_the_run_at_the_next_put(rl_episodes, tmp_path):
    trajs = rl_episodes
    writer = TraceWriter(tmp_path / "traces.sqlite")
    writer.put_episode(trajs[0], "rl", "train", 0, 1)
    # a malformed batch, one row for six episodes: the writer's update fails
    one_row = Batch.collate(trajs[:1], 0)
    writer.put_training(1, trajs, one_row, RLStepTensors(one_row.loss_mask, one_row.loss_mask))
    deadline = time.monotonic() + 10
    with pytest.raises(RunError, match=r"traces: writing .*traces.sqlite failed"):
        while time.monotonic() < deadline:
            writer.put_episode(trajs[1], "rl", "train", 0, 1)
            time.sleep(0.01)
    with pytest.raises(RunError, match="failed"):
        writer.close()
    with pytest.raises(RunError, match="is closed"):
        writer.put_ledger(2, 2, {})
    # what was committed before the failure is there
    assert len(query(tmp_path / "traces.sqlite")) >= 1


def test_reader_and_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no traces database"):
        connect(tmp_path / "missing.sqlite")
    TraceWriter(tmp_path / "t.sqlite").close()
    # a file of another schema version: one line naming it, to read and to append to
    old = traces_of_version(tmp_path / "old.sqlite", 1)
    with pytest.raises(RunFolderError, match=r"old.sqlite holds traces of schema version 1; "
                                             r"this tiller reads version 2"):
        connect(old)
    with pytest.raises(RunError, match=r"old.sqlite holds traces of schema version 1; this "
                                       r"tiller writes version 2: use a new output folder"):
        TraceWriter(old)
    with pytest.raises(ValueError, match="order_by: got 'tokens'; expected one of id, "):
        query(tmp_path / "t.sqlite", order_by="tokens")
    with pytest.raises(ValueError, match="limit must be >= 1"):
        query(tmp_path / "t.sqlite", limit=0)
    for override, words in (("observe.traces.sample_rate=1.5", "observe.traces.sample_rate"),
                            ("observe.traces.max_mb=0", "observe.traces.max_mb"),
                            ("observe.traces.sample=1", "observe.traces.sample")):
        with pytest.raises(ConfigError, match=words):
            load_config("configs/calculator.yaml", [override])


@pytest.mark.slow
def test_a_run_traces_every_episode_and_trains_the_same_with_traces_off(tmp_path):
    on = train(load_config("configs/calculator.yaml", [*RUN, "observe.traces.sample_rate=0.5"]),
               tmp_path / "on")
    train(load_config("configs/calculator.yaml", [*RUN, "observe.traces.enabled=false"]),
          tmp_path / "off")
    assert not (tmp_path / "off" / "traces.sqlite").exists()
    # bit-identical training: traces draw no random numbers and change no tensor
    assert [r for r in numbers(tmp_path / "on") if r["phase"] != "traces"] == numbers(
        tmp_path / "off")
    rows = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text()
            .splitlines()]
    for phase in ("rl", "eval_sft", "eval_rl"):  # the reward's breakdown, every step and eval
        for r in (r for r in rows if r["phase"] == phase):
            assert {"check/correct", "check/format_ok"} <= set(r)
    (final,) = [r for r in rows if r["phase"] == "traces"]
    con = connect(tmp_path / "on" / "traces.sqlite")
    count = dict(con.execute("SELECT phase, count(*) FROM episodes GROUP BY phase").fetchall())
    assert count["eval_sft"] == count["eval_rl"] == 16  # every eval episode
    ledger = on["rl"]["ledger"]
    # every RL episode that ended is written or sampled out: nothing is lost at close
    assert count["rl"] + final["traces/sampled_out"] == ledger["started"] == 32
    assert 8 <= count["rl"] <= 24 and final["traces/written"] == count["rl"] + 32
    assert final["traces/dropped_queue"] == final["traces/dropped_cap"] == 0
    trained = con.execute("SELECT n_tokens, trainer_logprobs, advantages FROM episodes "
                          "WHERE phase = 'rl' AND trained_step IS NOT NULL").fetchall()
    assert len(trained) == count["rl"] == final["traces/trained"]  # sync: all trained
    assert all(len(decode("advantages", a)) == len(decode("trainer_logprobs", lp)) == n
               for n, lp, a in trained)
    steps = con.execute("SELECT rl_step, ledger FROM steps ORDER BY rl_step").fetchall()
    assert [s for s, _ in steps] == [1, 2]
    assert json.loads(steps[-1][1])["trained"] == ledger["trained"]


@pytest.mark.slow
@pytest.mark.integration
def test_a_killed_run_leaves_a_readable_database(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path("src").resolve())}
    log = tmp_path / "stderr.log"  # a file, not a pipe: nobody reads a pipe until the end
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiller", "train", "configs/calculator.yaml", *RUN,
             "rl.steps=200", "-o", str(out)], env=env, stdout=subprocess.DEVNULL,
            stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 240
        rl = 0
        while rl < 32 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if (out / "traces.sqlite").exists():
                with closing(sqlite3.connect(out / "traces.sqlite")) as con:  # a plain reader
                    # the file exists a moment before its schema does
                    if con.execute("SELECT 1 FROM sqlite_master WHERE name = 'episodes'"
                                   ).fetchone():
                        (rl,) = con.execute(
                            "SELECT count(*) FROM episodes WHERE phase = 'rl'").fetchone()
        assert proc.poll() is None, log.read_text()
        assert rl >= 32, "no RL episodes written in time"
        proc.send_signal(signal.SIGKILL)  # mid-run: RL goes on for 200 steps
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    con = sqlite3.connect(out / "traces.sqlite")
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    n, = con.execute("SELECT count(*) FROM episodes WHERE phase = 'rl'").fetchone()
    assert n >= rl
    con.close()
    last = query(out / "traces.sqlite", phase="rl", order_by="id", descending=True, limit=1)[0]
    row = read_episode(out / "traces.sqlite", last["id"])
    assert len(row["token_ids"]) == len(row["loss_mask"]) == row["n_tokens"] > 0
