"""FaultInjector: seeded hangs, crashes and garbage in real tools, alone and under the executor."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from pydantic import ValidationError

from tiller.tools.executor import ExecutorConfig, ToolExecutor, ToolPolicy, probe_tools
from tiller.tools.executor import ToolReliabilityError as GateError
from tiller.tools.faults import FaultConfig, FaultInjector
from tiller.tools.registry import ToolCall, ToolOutcome, ToolRegistry, tool


@tool
async def double(x: int) -> int:
    """Double a number.

    Args:
        x: Any integer.
    """
    return 2 * x


@tool
async def negate(x: int) -> int:
    """Negate a number.

    Args:
        x: Any integer.
    """
    return -x


REGISTRY = ToolRegistry([double, negate])
RATES = FaultConfig(timeout_prob=0.1, crash_prob=0.15, garbage_prob=0.05, hang_s=0, seed=7)


def classify(r) -> str:
    if r.outcome is ToolOutcome.ENV_ERROR:
        return "timeout" if "TimeoutError" in r.content else "crash"
    if r.outcome is ToolOutcome.OK:
        return "clean" if r.content == str(2 * r.call.arguments["x"]) else "garbage"
    return "tool_error"


def run(config: FaultConfig, xs, key: str = "", concurrent: bool = False):
    injector = FaultInjector(config)
    invoke = injector.wrap(REGISTRY, key=key).invoke
    calls = [ToolCall("double", {"x": x}) for x in xs]

    async def main():
        if concurrent:
            return await asyncio.gather(*(invoke(c) for c in calls))
        return [await invoke(c) for c in calls]

    return asyncio.run(main()), injector


def outputs(results) -> list[tuple[ToolOutcome, str]]:
    return [(r.outcome, r.content) for r in results]


def by_x(results) -> dict[int, tuple[ToolOutcome, str]]:
    return dict(zip([r.call.arguments["x"] for r in results], outputs(results), strict=True))


def test_rates_are_within_tolerance_and_counted():
    results, injector = run(RATES, range(2000))
    kinds = [classify(r) for r in results]
    for kind, p in (("timeout", 0.1), ("crash", 0.15), ("garbage", 0.05)):
        # binomial sd is at most sqrt(2000 * 0.25) ~ 11 calls; allow ~4 sd
        assert abs(kinds.count(kind) - 2000 * p) < 45, (kind, kinds.count(kind))
        assert injector.injected[f"{kind}/double"] == kinds.count(kind)
    assert set(kinds) == {"clean", "timeout", "crash", "garbage"}


def test_same_seed_same_faults_other_seed_other_faults():
    first, _ = run(RATES, range(2000))
    second, _ = run(RATES, range(2000))
    other, _ = run(RATES.model_copy(update={"seed": 8}), range(2000))
    assert outputs(first) == outputs(second)
    assert outputs(first) != outputs(other)


def test_decisions_do_not_depend_on_call_order():
    forward, _ = run(RATES, range(300))
    backward, _ = run(RATES, reversed(range(300)))
    concurrent, _ = run(RATES, range(300), concurrent=True)
    assert by_x(forward) == by_x(backward) == by_x(concurrent)


def test_repeated_identical_calls_draw_independently():
    results, _ = run(FaultConfig(crash_prob=0.5, seed=1), [5] * 400)
    crashes = sum(r.outcome is ToolOutcome.ENV_ERROR for r in results)
    assert 150 < crashes < 250


def test_keys_separate_episodes():
    a, _ = run(RATES, range(300), key="task-1/seed-0")
    b, _ = run(RATES, range(300), key="task-2/seed-0")
    assert [classify(r) for r in a] != [classify(r) for r in b]


def test_injected_hang_is_cut_short_by_the_executor_timeout():
    injector = FaultInjector(FaultConfig(timeout_prob=1.0, hang_s=60))
    ex = ToolExecutor(injector.wrap(REGISTRY), ExecutorConfig(default=ToolPolicy(timeout_s=0.05)))
    start = time.perf_counter()
    r = asyncio.run(ex.invoke(ToolCall("double", {"x": 1})))
    assert time.perf_counter() - start < 0.5
    assert r.outcome is ToolOutcome.ENV_ERROR and r.timed_out
    assert ex.stats()["timeouts/double"] == 1


def test_executor_retries_recover_most_injected_faults():
    injector = FaultInjector(FaultConfig(timeout_prob=0.2, crash_prob=0.2, hang_s=60, seed=3))
    cfg = ExecutorConfig(default=ToolPolicy(timeout_s=0.02, retries=3, backoff_s=0.001))
    ex = ToolExecutor(injector.wrap(REGISTRY), cfg)

    async def main():
        return await asyncio.gather(*(ex.invoke(ToolCall("double", {"x": i})) for i in range(100)))

    results = asyncio.run(main())
    # a fault per attempt is 0.4, so all four attempts fail for about 0.4 ** 4 = 2.6% of calls
    assert sum(r.outcome is ToolOutcome.OK for r in results) >= 90
    s = ex.stats()
    assert s["retries/double"] > 0 and s["timeouts/double"] > 0


def test_bad_arguments_stay_the_policys_tool_error():
    injector = FaultInjector(FaultConfig(crash_prob=1.0))
    invoke = injector.wrap(REGISTRY).invoke
    bad = asyncio.run(invoke(ToolCall("double", {"x": "seven"})))
    good = asyncio.run(invoke(ToolCall("double", {"x": 7})))
    assert bad.outcome is ToolOutcome.TOOL_ERROR
    assert good.outcome is ToolOutcome.ENV_ERROR and "InjectedFault: injected crash" in good.content


def test_only_the_listed_tools_are_faulted():
    invoke = FaultInjector(FaultConfig(crash_prob=1.0, tools=["negate"])).wrap(REGISTRY).invoke
    assert asyncio.run(invoke(ToolCall("double", {"x": 2}))).content == "4"
    assert asyncio.run(invoke(ToolCall("negate", {"x": 2}))).outcome is ToolOutcome.ENV_ERROR


def test_probabilities_must_sum_to_at_most_one():
    with pytest.raises(ValidationError, match="at most 1"):
        FaultConfig(timeout_prob=0.5, crash_prob=0.4, garbage_prob=0.2)


def test_gate_catches_an_unreliable_tool():
    injector = FaultInjector(FaultConfig(crash_prob=0.2, tools=["negate"], seed=2))
    calls = [ToolCall(name, {"x": i}) for i in range(200) for name in ("double", "negate")]
    report = asyncio.run(probe_tools(injector.wrap(REGISTRY), calls))
    assert report.rates()["double"] == 1.0 and report.rates()["negate"] < 0.9
    with pytest.raises(GateError, match=r"negate succeeded \d+/200 \(\d+\.\d%\)"):
        report.check()


def test_heavy_tailed_latency_is_seeded_counted_and_slept():
    config = FaultConfig(latency_s=0.002, slow_prob=0.1, slow_s=0.03, seed=3)
    wall = time.perf_counter()
    results, injector = run(config, range(100))  # one at a time: the sleeps add up
    wall = time.perf_counter() - wall
    assert all(classify(r) == "clean" for r in results)  # latency is not a fault
    slow = injector.injected["slow/double"]
    assert 3 <= slow <= 20  # ~10 of 100 (binomial sd 3)
    assert wall >= slow * 0.03 + (100 - slow) * 0.002
    _, again = run(config, reversed(range(100)), concurrent=True)
    assert again.injected["slow/double"] == slow  # drawn per call, not per position
    draws = [FaultInjector(config).delay(random.Random(i), "double") for i in range(1000)]
    assert set(draws) == {0.002, 0.03} and 60 < draws.count(0.03) < 140
