"""ToolExecutor and the reliability gate, against small real tools (no mocks)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from pydantic import ValidationError

from tiller.tools.executor import (
    UNKNOWN_TOOL,
    ExecutorConfig,
    ToolExecutor,
    ToolPolicy,
    ToolReliabilityError,
    probe_tools,
)
from tiller.tools.registry import ToolCall, ToolError, ToolOutcome, ToolRegistry, tool
from tiller.tools.threads import abandoned_threads


def fast(**knobs) -> ExecutorConfig:
    """A config whose retries wait a millisecond, so tests spend no time backing off."""
    return ExecutorConfig(default=ToolPolicy(timeout_s=1.0, backoff_s=0.001, **knobs))


@tool
async def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return "awake"


@tool
def sync_nap(seconds: float) -> str:
    """Sleep in a worker thread, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def make_flaky(failures: int):
    """A tool whose first `failures` calls crash (a service coming up), and its call log."""
    log: list[int] = []

    @tool
    async def flaky(x: int) -> int:
        """Echo x once the service is up.

        Args:
            x: Any number.
        """
        log.append(x)
        if len(log) <= failures:
            raise ConnectionError("service unavailable")
        return x

    return flaky, log


def make_picky():
    log: list[str] = []

    @tool
    async def picky(word: str) -> str:
        """Accept only lowercase words.

        Args:
            word: A lowercase word.
        """
        log.append(word)
        if word != word.lower():
            raise ToolError(f"{word!r} is not lowercase")
        return word

    return picky, log


def test_timeout_is_env_error_within_bounded_time():
    ex = ToolExecutor(ToolRegistry([nap]), ExecutorConfig(default=ToolPolicy(timeout_s=0.05)))
    start = time.perf_counter()
    r = asyncio.run(ex.invoke(ToolCall("nap", {"seconds": 10})))
    assert time.perf_counter() - start < 0.5
    assert r.outcome is ToolOutcome.ENV_ERROR and r.timed_out and r.attempts == 1
    assert "nap timed out after 0.05s" in r.content
    assert ex.stats()["timeouts/nap"] == 1 and ex.stats()["env_error_rate/nap"] == 1.0


def test_sync_tool_times_out_too():
    ex = ToolExecutor(ToolRegistry([sync_nap]), ExecutorConfig(default=ToolPolicy(timeout_s=0.05)))
    start = time.perf_counter()
    r = asyncio.run(ex.invoke(ToolCall("sync_nap", {"seconds": 0.3})))
    assert r.outcome is ToolOutcome.ENV_ERROR and r.timed_out
    assert r.latency_s < 0.25  # answered at the deadline, not when the thread finished
    assert time.perf_counter() - start < 1.0


def test_hung_sync_tool_does_not_hold_up_the_phase():
    """A timed-out sync tool's thread is abandoned (counted), and `asyncio.run` returns at the
    timeout, not when the thread ends (it used to wait for the default executor's threads)."""
    release = threading.Event()

    @tool
    def hang() -> str:
        """Block until released (bounded, so a broken fix cannot hang the test run)."""
        release.wait(30)
        return "released"

    ex = ToolExecutor(ToolRegistry([hang]), ExecutorConfig(default=ToolPolicy(timeout_s=0.2)))
    before = abandoned_threads()
    start = time.perf_counter()
    try:
        r = asyncio.run(ex.invoke(ToolCall("hang", {})))
        elapsed = time.perf_counter() - start
    finally:
        release.set()
    assert r.outcome is ToolOutcome.ENV_ERROR and r.timed_out
    assert elapsed < 10  # 30 without the fix; the bound is loose for a busy machine
    assert abandoned_threads() == before + 1


def test_retries_recover_a_flaky_tool_and_are_counted():
    flaky, log = make_flaky(failures=2)
    ex = ToolExecutor(ToolRegistry([flaky]), fast(retries=3))
    r = asyncio.run(ex.invoke(ToolCall("flaky", {"x": 7})))
    assert r.outcome is ToolOutcome.OK and r.content == "7" and r.attempts == 3
    assert log == [7, 7, 7]
    s = ex.stats()
    assert s["calls/flaky"] == 1 and s["retries/flaky"] == 2 and s["ok_rate/flaky"] == 1.0


def test_retries_give_up_after_the_budget():
    flaky, log = make_flaky(failures=10)
    ex = ToolExecutor(ToolRegistry([flaky]), fast(retries=2))
    r = asyncio.run(ex.invoke(ToolCall("flaky", {"x": 1})))
    assert r.outcome is ToolOutcome.ENV_ERROR and r.attempts == 3 and len(log) == 3
    assert "ConnectionError: service unavailable" in r.content


def test_backoff_grows_exponentially():
    flaky, _ = make_flaky(failures=2)
    cfg = ExecutorConfig(default=ToolPolicy(retries=2, backoff_s=0.02, jitter=0.0))
    ex = ToolExecutor(ToolRegistry([flaky]), cfg)
    start = time.perf_counter()
    assert asyncio.run(ex.invoke(ToolCall("flaky", {"x": 1}))).outcome is ToolOutcome.OK
    assert time.perf_counter() - start >= 0.02 + 0.04


def test_tool_error_is_never_retried():
    picky, log = make_picky()
    ex = ToolExecutor(ToolRegistry([picky]), fast(retries=5))

    async def main():
        rejected = await ex.invoke(ToolCall("picky", {"word": "LOUD"}))
        invalid = await ex.invoke(ToolCall("picky", {"word": 3, "extra": 1}))
        unknown = await ex.invoke(ToolCall("nope", {}))
        return rejected, invalid, unknown

    rejected, invalid, unknown = asyncio.run(main())
    for r in (rejected, invalid, unknown):
        assert r.outcome is ToolOutcome.TOOL_ERROR and r.attempts == 1
    assert log == ["LOUD"]  # the invalid call never reached the tool
    s = ex.stats()
    assert s["retries/picky"] == 0 and s["tool_error_rate/picky"] == 1.0
    assert s[f"calls/{UNKNOWN_TOOL}"] == 1  # invented names are pooled, not one metric each


def test_cache_hit_does_not_call_the_tool_again():
    calls: list[dict] = []

    @tool
    async def lookup(city: str, unit: str = "C") -> str:
        """Deterministic weather.

        Args:
            city: A city.
            unit: C or F.
        """
        calls.append({"city": city, "unit": unit})
        return f"{city}: 20{unit}"

    flaky, flaky_log = make_flaky(failures=1)
    cfg = ExecutorConfig(default=ToolPolicy(cache=True, backoff_s=0.001),
                         tools={"flaky": ToolPolicy(cache=True)})
    ex = ToolExecutor(ToolRegistry([lookup, flaky]), cfg)

    async def main():
        first = await ex.invoke(ToolCall("lookup", {"city": "Oslo", "unit": "F"}))
        again = await ex.invoke(ToolCall("lookup", {"unit": "F", "city": "Oslo"}))  # key order
        other = await ex.invoke(ToolCall("lookup", {"city": "Lima"}))
        failed = await ex.invoke(ToolCall("flaky", {"x": 1}))
        retried = await ex.invoke(ToolCall("flaky", {"x": 1}))
        return first, again, other, failed, retried

    first, again, other, failed, retried = asyncio.run(main())
    assert first.content == again.content == "Oslo: 20F" and other.content == "Lima: 20C"
    assert not first.cached and again.cached and again.attempts == 0
    assert len(calls) == 2
    # an env_error is not cached: the second call reaches the tool and succeeds
    assert failed.outcome is ToolOutcome.ENV_ERROR and retried.outcome is ToolOutcome.OK
    assert len(flaky_log) == 2
    assert ex.stats()["cache_hits/lookup"] == 1 and ex.stats()["ok_rate/lookup"] == 1.0


def test_uncached_tool_runs_every_time():
    calls: list[int] = []

    @tool
    async def count(x: int) -> int:
        """Count calls.

        Args:
            x: Anything.
        """
        calls.append(x)
        return len(calls)

    ex = ToolExecutor(ToolRegistry([count]), fast())

    async def main():
        return [(await ex.invoke(ToolCall("count", {"x": 1}))).content for _ in range(3)]

    assert asyncio.run(main()) == ["1", "2", "3"]


def make_gauge():
    """A tool that records the most calls it ever saw running at once."""
    state = {"now": 0, "max": 0}

    @tool
    async def gauge(i: int) -> int:
        """Hold a slot briefly.

        Args:
            i: Call index.
        """
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return i

    return gauge, state


@pytest.mark.parametrize("where", ["global", "per_tool", "none"])
def test_concurrency_limit_bounds_parallelism(where):
    gauge, state = make_gauge()
    cfg = {
        "global": ExecutorConfig(max_concurrency=3),
        "per_tool": ExecutorConfig(tools={"gauge": ToolPolicy(max_concurrency=2)}),
        "none": ExecutorConfig(),
    }[where]
    ex = ToolExecutor(ToolRegistry([gauge]), cfg)

    async def main():
        return await asyncio.gather(*(ex.invoke(ToolCall("gauge", {"i": i})) for i in range(12)))

    results = asyncio.run(main())
    assert [r.content for r in results] == [str(i) for i in range(12)]
    assert state["max"] == {"global": 3, "per_tool": 2, "none": 12}[where]


def test_per_tool_overrides_keep_the_other_defaults():
    cfg = ExecutorConfig.model_validate(
        {"default": {"retries": 2, "timeout_s": 9}, "tools": {"search": {"timeout_s": 1}}}
    )
    assert cfg.policy("search") == ToolPolicy(retries=2, timeout_s=1)
    assert cfg.policy("other") == ToolPolicy(retries=2, timeout_s=9)
    with pytest.raises(ValidationError):
        ExecutorConfig.model_validate({"tools": {"search": {"retires": 1}}})


def test_stats_reset_starts_a_new_window():
    ex = ToolExecutor(ToolRegistry([nap]), fast())
    asyncio.run(ex.invoke(ToolCall("nap", {"seconds": 0})))
    assert ex.stats(reset=True)["calls/nap"] == 1
    assert ex.stats()["calls/nap"] == 0


def test_wraps_a_bare_invoke_callable_and_survives_it_raising():
    async def broken(call: ToolCall):
        raise RuntimeError("down")

    ex = ToolExecutor(broken, fast(retries=1))
    r = asyncio.run(ex.invoke(ToolCall("anything", {})))
    assert r.outcome is ToolOutcome.ENV_ERROR and r.attempts == 2
    assert "RuntimeError: down" in r.content


# --- reliability gate ---------------------------------------------------------------------


@tool
async def shaky(x: int) -> int:
    """Fail on every tenth input.

    Args:
        x: Any number.
    """
    if x % 10 == 0:
        raise OSError("disk full")
    return x


@tool
async def solid(x: int) -> int:
    """Never fail.

    Args:
        x: Any number.
    """
    return x


def probe(threshold: float):
    calls = [ToolCall(name, {"x": i}) for i in range(100) for name in ("shaky", "solid")]
    return asyncio.run(probe_tools(ToolRegistry([shaky, solid]), calls, threshold=threshold))


def test_gate_refuses_below_threshold_naming_tool_and_rate():
    report = probe(0.95)
    assert report.rates() == {"shaky": 0.9, "solid": 1.0}
    with pytest.raises(ToolReliabilityError) as e:
        report.check()
    msg = str(e.value)
    assert "shaky" in msg and "90.0%" in msg and "90/100" in msg and "disk full" in msg
    assert "solid" not in msg


def test_gate_passes_above_threshold():
    probe(0.9).check()


def test_gate_override_logs_instead_of_refusing(caplog):
    with caplog.at_level(logging.WARNING, logger="tiller.tools.executor"):
        probe(0.95).check(override=True)
    assert "overridden" in caplog.text and "shaky" in caplog.text


def test_identical_calls_in_flight_wait_for_the_first_instead_of_missing_the_cache():
    """Episodes of one group make the same call at the same moment: the first runs, the rest
    wait for it and are cache hits. When the first fails, the next one runs itself."""
    runs = []

    @tool
    async def square(x: int) -> int:
        """Square slowly, failing the first time.

        Args:
            x: The number.
        """
        runs.append(x)
        await asyncio.sleep(0.02)
        if len(runs) == 1:
            raise OSError("service hiccup")  # env_error: not cached
        return x * x

    ex = ToolExecutor(ToolRegistry([square]), fast(cache=True))

    async def main():
        return await asyncio.gather(*(ex.invoke(ToolCall("square", {"x": 7})) for _ in range(5)))

    results = asyncio.run(main())
    assert [r.outcome for r in results] == [ToolOutcome.ENV_ERROR] + [ToolOutcome.OK] * 4
    assert [r.cached for r in results] == [False, False, True, True, True]
    assert runs == [7, 7]
    stats = ex.stats()
    assert (stats["calls/square"], stats["cache_hits/square"]) == (5, 3)


def test_one_executor_serves_successive_loops_but_not_two_at_once():
    """A run calls through one executor from a fresh asyncio.run per phase: the limits are
    rebuilt per loop. Two loops at once would share nothing safely, so that is an error."""
    started, release = threading.Event(), threading.Event()

    @tool
    def hold() -> str:
        """Signal that the call runs, then wait to be released (bounded)."""
        started.set()
        release.wait(10)
        return "released"

    ex = ToolExecutor(ToolRegistry([nap, hold]), fast(max_concurrency=1))
    for _ in range(2):  # asyncio semaphores bound to the first loop would fail in the second
        assert asyncio.run(ex.invoke(ToolCall("nap", {"seconds": 0}))).content == "awake"

    other = threading.Thread(target=asyncio.run, args=(ex.invoke(ToolCall("hold", {})),))
    other.start()
    try:
        assert started.wait(10)  # the other loop's call is running
        with pytest.raises(RuntimeError, match="second event loop"):
            asyncio.run(ex.invoke(ToolCall("nap", {"seconds": 0})))
    finally:
        release.set()
        other.join()
    assert ex.stats()["calls/nap"] == 2 and ex.stats()["calls/hold"] == 1  # refused: never ran
