"""ReplayStore: record real, non-deterministic tools into a SQLite file and replay them."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import TINY_RUN

from tiller.config import ConfigError, load_config
from tiller.controller import train
from tiller.tools.executor import ExecutorConfig, ToolExecutor, ToolPolicy
from tiller.tools.registry import ToolCall, ToolError, ToolOutcome, ToolRegistry, tool
from tiller.tools.replay import ReplayStore
from tiller.tools.stack import ReplayConfig, ToolsConfig, ToolStack


@tool
async def roll(sides: int) -> str:
    """Roll a die and read the clock: a different answer every call.

    Args:
        sides: Number of sides; must be positive.
    """
    if sides < 1:
        raise ToolError("a die needs at least one side")
    return f"{random.randint(1, sides)} at {time.time_ns()} ✓"


@tool(name="roll")
async def roll_disabled(sides: int) -> str:
    """Stands in for `roll` once the live tool must not run.

    Args:
        sides: Number of sides.
    """
    raise AssertionError("the live tool was called during replay")


LIVE, DEAD = ToolRegistry([roll]), ToolRegistry([roll_disabled])
SEQUENCE = [ToolCall("roll", {"sides": s}) for s in (6, 6, 20, 6, 0, 20, 1_000_000, 6)]


async def run_calls(invoke, calls):
    return [await invoke(c) for c in calls]


def test_record_then_replay_is_byte_identical_in_order(tmp_path):
    db = tmp_path / "calls.sqlite"
    with ReplayStore(db, "record") as store:
        recorded = asyncio.run(run_calls(store.wrap(LIVE, key="task-1/seed-0"), SEQUENCE))
        assert len(store) == len(SEQUENCE)
    assert len({r.content for r in recorded if r.call.arguments["sides"] == 6}) == 4  # all differ
    assert recorded[4].outcome is ToolOutcome.TOOL_ERROR

    with ReplayStore(db, "replay") as store:  # a fresh process would see the same file
        replayed = asyncio.run(run_calls(store.wrap(DEAD, key="task-1/seed-0"), SEQUENCE))
        again = asyncio.run(run_calls(store.wrap(DEAD, key="task-1/seed-0"), SEQUENCE))
        assert store.misses == 0
    for rec, rep, rep2 in zip(recorded, replayed, again, strict=True):
        assert rep.content.encode() == rec.content.encode() == rep2.content.encode()
        assert rep.outcome is rec.outcome and rep.call == rec.call


def test_replay_of_unseen_call_is_a_clear_env_error(tmp_path):
    db = tmp_path / "calls.sqlite"
    with ReplayStore(db, "record") as store:
        asyncio.run(run_calls(store.wrap(LIVE, key="ep"), SEQUENCE[:2]))
    with ReplayStore(db, "replay") as store:
        invoke = store.wrap(DEAD, key="ep")
        results = asyncio.run(run_calls(invoke, [*SEQUENCE[:2], SEQUENCE[0]]))
        other_key = asyncio.run(store.wrap(DEAD, key="other")(SEQUENCE[0]))
        assert store.misses == 2
    assert [r.outcome for r in results[:2]] == [ToolOutcome.OK, ToolOutcome.OK]
    miss = results[2]  # a third roll(6) under "ep": only two were recorded
    assert miss.outcome is ToolOutcome.ENV_ERROR
    assert 'replay miss' in miss.content and 'roll({"sides":6})' in miss.content
    assert "occurrence 2" in miss.content and "'ep'" in miss.content
    assert other_key.outcome is ToolOutcome.ENV_ERROR and "'other'" in other_key.content


def test_replay_or_live_falls_through_and_records(tmp_path):
    db = tmp_path / "calls.sqlite"
    with ReplayStore(db, "record") as store:
        first = asyncio.run(store.wrap(LIVE, key="ep")(SEQUENCE[0]))
    with ReplayStore(db, "replay_or_live") as store:
        mixed = asyncio.run(run_calls(store.wrap(LIVE, key="ep"), SEQUENCE[:3]))
        assert len(store) == 3
    assert mixed[0].content == first.content  # served from the store
    with ReplayStore(db, "replay") as store:
        replayed = asyncio.run(run_calls(store.wrap(DEAD, key="ep"), SEQUENCE[:3]))
    assert [r.content for r in replayed] == [r.content for r in mixed]


def test_record_overwrites_a_rerecorded_episode(tmp_path):
    db = tmp_path / "calls.sqlite"
    with ReplayStore(db, "record") as store:
        asyncio.run(run_calls(store.wrap(LIVE, key="ep"), SEQUENCE))
        second = asyncio.run(run_calls(store.wrap(LIVE, key="ep"), SEQUENCE))
        assert len(store) == len(SEQUENCE)
    with ReplayStore(db, "replay") as store:
        replayed = asyncio.run(run_calls(store.wrap(DEAD, key="ep"), SEQUENCE))
    assert [r.content for r in replayed] == [r.content for r in second]


def test_composes_with_the_executor(tmp_path):
    """Wrapped outside the executor, the store records what the policy saw after retries."""
    log: list[int] = []

    @tool
    async def flaky(x: int) -> str:
        """Fail the first call, then answer.

        Args:
            x: Anything.
        """
        log.append(x)
        if len(log) == 1:
            raise ConnectionError("warming up")
        return f"{x}:{random.random()}"

    cfg = ExecutorConfig(default=ToolPolicy(retries=2, backoff_s=0.001))
    ex = ToolExecutor(ToolRegistry([flaky]), cfg)
    db = tmp_path / "calls.sqlite"
    with ReplayStore(db, "record") as store:
        live = asyncio.run(store.wrap(ex.invoke, key="ep")(ToolCall("flaky", {"x": 3})))
    with ReplayStore(db, "replay") as store:
        replayed = asyncio.run(store.wrap(DEAD, key="ep")(ToolCall("flaky", {"x": 3})))
    assert live.outcome is ToolOutcome.OK and live.attempts == 2
    assert replayed.content == live.content and len(log) == 2


def test_many_concurrent_episodes_across_threads(tmp_path):
    """Episodes run concurrently on several event loops in several threads share one store."""
    db = tmp_path / "calls.sqlite"

    async def episodes(store, target, first):
        keys = [f"ep-{first + i}" for i in range(10)]
        runs = [run_calls(store.wrap(target, key=k), SEQUENCE) for k in keys]
        return dict(zip(keys, await asyncio.gather(*runs), strict=True))

    def in_threads(store, target):
        with ThreadPoolExecutor(4) as pool:
            parts = pool.map(lambda t: asyncio.run(episodes(store, target, 10 * t)), range(4))
        return {k: [r.content for r in v] for part in parts for k, v in part.items()}

    with ReplayStore(db, "record") as store:
        recorded = in_threads(store, LIVE)
        assert len(store) == 40 * len(SEQUENCE)
    with ReplayStore(db, "replay") as store:
        assert in_threads(store, DEAD) == recorded
        assert store.misses == 0
    mode = sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_unknown_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="replay mode must be one of"):
        ReplayStore(tmp_path / "x.sqlite", "playback")


@pytest.mark.parametrize("where, mode, message", [
    ("{tmp}/no/such/folder/tools.sqlite", "record", "the folder .* does not exist"),
    ("{tmp}/never-recorded.sqlite", "replay", "mode 'replay' needs a recorded file"),
])
def test_bad_replay_path_is_one_line_config_error_before_any_work(tmp_path, where, mode,
                                                                    message):
    """A replay file in a missing folder was an sqlite3 traceback after the model was built."""
    path = where.format(tmp=tmp_path)
    cfg = load_config("configs/calculator.yaml",
                      [*TINY_RUN, f"env.tools.replay={{path: {path}, mode: {mode}}}"])
    with pytest.raises(ConfigError, match=rf"^config field env.tools.replay.path: .*{message}"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "base_model").exists()  # refused before building the model


def test_a_relative_replay_path_may_leave_the_run_folder(tmp_path):
    """`../shared/tools.sqlite` (relative to the run folder, leaving it) crashed the stack
    with a ValueError traceback from folder_below; it is the user's own path, used as
    written (docs/evaluation.md lists it among the files written outside the run folder), and
    one whose folder is missing is the one-line ConfigError."""
    (tmp_path / "run").mkdir()
    (tmp_path / "shared").mkdir()
    tools = ToolsConfig(replay={"path": "../shared/tools.sqlite", "mode": "record"})
    stack = ToolStack(tools, tmp_path / "run")
    try:
        asyncio.run(stack.wrapper("ep")(LIVE)(SEQUENCE[0]))
    finally:
        stack.close()
    assert stack.store is not None and stack.store.path == tmp_path / "shared" / "tools.sqlite"
    assert (tmp_path / "shared" / "tools.sqlite").is_file()
    assert not (tmp_path / "run" / "shared").exists()
    missing = ToolsConfig(replay={"path": "../nowhere/tools.sqlite", "mode": "record"})
    with pytest.raises(ConfigError, match=r"^config field env.tools.replay.path: got "
                                          rf"'{tmp_path}/nowhere/tools.sqlite'; the folder"):
        ToolStack(missing, tmp_path / "run")


def test_replay_misses_are_in_the_stack_stats_per_window(tmp_path):
    """Misses reach the per-step tool metrics (`replay_misses`), counted since the last reset."""
    db = tmp_path / "calls.sqlite"
    with ReplayStore(db, "record") as store:
        asyncio.run(run_calls(store.wrap(LIVE, key="ep"), SEQUENCE[:2]))
    stack = ToolStack(ToolsConfig(replay=ReplayConfig(path=str(db), mode="replay")), tmp_path)
    try:
        invoke = stack.wrapper("ep")(DEAD)
        asyncio.run(run_calls(invoke, [*SEQUENCE[:2], SEQUENCE[0], SEQUENCE[0]]))
        assert stack.stats(reset=True)["replay_misses"] == 2.0
        assert stack.stats(reset=True)["replay_misses"] == 0.0  # a new window
        asyncio.run(stack.wrapper("other")(DEAD)(SEQUENCE[0]))
        assert stack.stats()["replay_misses"] == 1.0
    finally:
        stack.close()
