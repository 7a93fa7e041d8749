"""The run's tool stack on real episodes: faults become env_errors, replay is byte-exact."""

import asyncio

from tiller.envs import ENVS
from tiller.rollout.agent_loop import ExpertActor, run_episode
from tiller.rollout.buffer import DataBuffer
from tiller.rollout.trajectory import Status
from tiller.tools.executor import ExecutorConfig, ToolPolicy
from tiller.tools.faults import FaultConfig
from tiller.tools.registry import ToolCall, ToolRegistry, tool
from tiller.tools.stack import ReplayConfig, ToolsConfig, ToolStack
from tiller.train.batch import Batch

Calc = ENVS["calculator"]


def expert_episodes(stack, tokenizer, limits, n=60, tag="run"):
    tasks = Calc.make_tasks("train", n, 0, 2)

    async def go():
        return await asyncio.gather(*(
            run_episode(Calc(wrap=stack.wrapper(f"{tag}/{t.id}")), t,
                        ExpertActor(Calc, t, tokenizer), tokenizer, seed=i, limits=limits)
            for i, t in enumerate(tasks)))

    return asyncio.run(go())


def faulty(timeout=0.1, crash=0.05, garbage=0.0, seed=0):
    """Injected hangs (10 s) cut by a 2 s timeout (at 0.5 s, beside a benchmark at nice -20,
    real calls timed out too: the fault test asserts every timeout is an injected one)."""
    return ToolsConfig(
        executor=ExecutorConfig(default=ToolPolicy(timeout_s=2.0, retries=0)),
        faults=FaultConfig(timeout_prob=timeout, crash_prob=crash, garbage_prob=garbage,
                           hang_s=10.0, seed=seed),
    )


def test_injected_timeouts_and_crashes_are_env_errors_kept_out_of_the_loss(
        tmp_path, tokenizer, limits):
    stack = ToolStack(faulty(), tmp_path)
    trajs = expert_episodes(stack, tokenizer, limits, n=80)
    stats = stack.stats()
    hit = [t for t in trajs if t.status is Status.ENV_ERROR]
    assert 0.05 < stats["env_error_rate/calculate"] < 0.3  # ~15% of calls injected
    assert stats["tool_timeouts/calculate"] > 0
    # retries=0: each injected hang is one timeout, and no real call was cut
    assert stats["tool_timeouts/calculate"] == stack.injector.injected["timeout/calculate"]
    assert hit and all(t.reward.env_error and t.env_errors for t in hit)
    clean = [t for t in trajs if t.status is Status.COMPLETED]
    assert all(t.reward.value == 1.0 for t in clean)  # the expert never fails on its own

    buffer = DataBuffer()
    kept = buffer.admit(trajs)
    assert buffer.ledger["dropped/env_error"] == len(hit)
    assert not any(t.status is Status.ENV_ERROR for t in kept)
    batch = Batch.collate(kept, tokenizer.pad_token_id, [1.0] * len(kept))
    assert float(batch.loss_mask.sum()) == sum(t.num_generated for t in kept)


def tool_outputs(trajs):
    return [[m["content"] for m in t.messages if m["role"] == "tool"] for t in trajs]


def test_record_then_replay_with_every_live_call_crashing(tmp_path, tokenizer, limits):
    db = tmp_path / "tools.sqlite"
    # Recorded tools are non-deterministic: a third of the calls return seeded garbage.
    record = ToolsConfig(replay=ReplayConfig(path=str(db), mode="record"),
                         faults=FaultConfig(garbage_prob=0.3, seed=11))
    stack = ToolStack(record, tmp_path)
    recorded = expert_episodes(stack, tokenizer, limits, n=20)
    stack.close()
    garbage = sum(not o.lstrip("-").isdigit() for outs in tool_outputs(recorded) for o in outs)
    assert garbage > 0

    # Replay with the tools disabled: any call that reached them would crash.
    replay = ToolsConfig(replay=ReplayConfig(path=str(db), mode="replay"),
                         faults=FaultConfig(crash_prob=1.0))
    stack = ToolStack(replay, tmp_path)
    replayed = expert_episodes(stack, tokenizer, limits, n=20)
    assert stack.store.misses == 0
    assert tool_outputs(replayed) == tool_outputs(recorded)
    assert [t.token_ids for t in replayed] == [t.token_ids for t in recorded]


def test_gate_reports_the_failing_tool(tmp_path, tokenizer, limits):
    stack = ToolStack(faulty(timeout=0.0, crash=0.2), tmp_path)
    expert_episodes(stack, tokenizer, limits, n=30)
    report = stack.probe_report()
    assert report.failing() and "calculate" in report.failing()
    try:
        report.check()
    except RuntimeError as e:
        assert "calculate succeeded" in str(e) and "env_error" in str(e)
    else:
        raise AssertionError("the gate let a 20%-crashing tool through")
    healthy = ToolStack(ToolsConfig(), tmp_path)
    expert_episodes(healthy, tokenizer, limits, n=10)
    assert healthy.probe_report().failing() == {}


def episode_registry(state):
    """A fresh registry per episode (like a per-episode database) whose tool records the most
    calls it saw running at once, across every episode sharing `state`."""

    @tool
    async def lookup(key: int) -> int:
        """Look a key up in a slow service.

        Args:
            key: The key.
        """
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        state["calls"] += 1
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return key * 10

    return ToolRegistry([lookup])


def test_run_level_limits_and_cache_span_episodes_and_event_loops(tmp_path):
    """One executor per run: max_concurrency bounds all episodes together, and a result cached
    by one episode (or in an earlier phase, i.e. event loop) is a hit for the next."""
    state = {"now": 0, "max": 0, "calls": 0}
    cfg = ToolsConfig(executor=ExecutorConfig(
        max_concurrency=1, tools={"lookup": ToolPolicy(cache=True, cache_scope="run")}))
    stack = ToolStack(cfg, tmp_path)

    async def phase(tag, keys):
        invokes = [stack.wrapper(f"{tag}/{i}")(episode_registry(state)) for i in range(len(keys))]
        results = await asyncio.gather(*(
            invoke(ToolCall("lookup", {"key": k}))
            for invoke, k in zip(invokes, keys, strict=True)))
        return [r.content for r in results]

    assert asyncio.run(phase("a", range(8))) == [str(k * 10) for k in range(8)]
    assert state["max"] == 1  # 8 episodes, one call at a time
    first = stack.stats(reset=True)
    assert (first["tool_calls/lookup"], first["tool_peak_concurrency/lookup"]) == (8, 1)
    assert asyncio.run(phase("b", [3, 3, 9, 3])) == ["30", "30", "90", "30"]  # a new loop
    second = stack.stats(reset=True)
    assert second["tool_cache_hits/lookup"] == 3  # key 3 was cached in the first phase
    assert state["calls"] == 9  # only key 9 reached the tool again


def test_cache_does_not_leak_a_query_between_episodes(tmp_path):
    """Each SQL task has its own database: the same query must not get another task's rows
    from the run's cache (the default scope is the episode), but repeats within one episode
    are hits."""
    cfg = ToolsConfig(executor=ExecutorConfig(tools={"query": ToolPolicy(cache=True)}))
    stack = ToolStack(cfg, tmp_path)
    sql_env = ENVS["sql"]
    tasks = sql_env.make_tasks("train", 2, seed=0)
    assert tasks[0].metadata["db_seed"] != tasks[1].metadata["db_seed"]
    call = ToolCall("query", {"sql": "SELECT * FROM employees ORDER BY id"})

    async def episode(i, task):
        env = sql_env(wrap=stack.wrapper(f"run/{i}"))
        await env.reset(task, seed=i)
        first, again = await env.invoke(call), await env.invoke(call)
        await env.close()
        return first, again

    results = [asyncio.run(episode(i, task)) for i, task in enumerate(tasks)]
    (a, a2), (b, b2) = results
    assert a.outcome.value == b.outcome.value == "ok", (a.content, b.content)
    assert a.content != b.content and not b.cached  # different databases, different rows
    assert a2.cached and b2.cached and (a2.content, b2.content) == (a.content, b.content)
