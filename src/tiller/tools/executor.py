"""The tool executor: timeouts, retries, a result cache and concurrency limits around tool calls.

Real tools hang, crash and rate-limit. `ToolExecutor.invoke` has the shape of
`ToolRegistry.invoke` (a `ToolCall` in, a `ToolResult` out, never raises), so it stands in for
it behind an environment's registry (see `tiller.tools.stack.ToolStack`), and adds what a long
training run needs:

- a timeout per attempt: a tool that runs past it is an `env_error`, not a stuck episode;
- retries with exponential backoff and seeded jitter, for `env_error` only. A `tool_error` is the
  policy's mistake (bad arguments, a rejected input) and the same call would fail again;
- an opt-in result cache for deterministic tools (only `ok` results are kept); identical calls
  made while the first is running wait for it instead of all missing the cache. A cached result
  is reused only within its episode (`cache_scope="episode"`, the default: a tool bound to the
  episode's state, e.g. its own database, answers the same call differently per episode), or
  across the run for tools declared stateless (`cache_scope="run"`);
- a global and a per-tool concurrency limit, so a burst of episodes cannot overload a service;
- per-tool counters (`stats()`) the trainer logs next to the rewards.

A run shares one executor across all its episodes (`bind` puts each episode's own registry
behind it), so the limits, the cache and the counters are the run's, not an episode's.

This module also holds the tool reliability gate (`probe_tools`), which runs scripted calls
before training and refuses a tool set that fails too often to give a meaningful reward.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tiller.tools.registry import ToolCall, ToolOutcome, ToolRegistry, ToolResult

logger = logging.getLogger(__name__)

Invoke = Callable[[ToolCall], Awaitable[ToolResult]]
UNKNOWN_TOOL = "_unknown"


def as_invoke(target: ToolRegistry | Invoke) -> Invoke:
    """The invoke callable of a registry, or the callable itself: every wrapper takes both."""
    return target.invoke if isinstance(target, ToolRegistry) else target


def canonical_json(value: Any) -> str:
    """One string per JSON value whatever its key order: the identity of a call's arguments
    for the cache, the replay store and the fault RNG."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=repr)


class ToolPolicy(BaseModel):
    """How one tool is run. In `ExecutorConfig.tools`, only the fields written override the
    default policy, so `{"search": {"timeout_s": 5}}` keeps every other default knob."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float | None = Field(30.0, gt=0, description="per attempt; None = no timeout")
    retries: int = Field(0, ge=0, description="extra attempts after an env_error")
    backoff_s: float = Field(0.1, ge=0, description="first retry delay; doubles each retry")
    jitter: float = Field(0.5, ge=0, le=1, description="delay is scaled by 1 ± jitter")
    cache: bool = Field(False, description="reuse ok results; only for deterministic tools")
    cache_scope: Literal["episode", "run"] = Field(
        "episode", description="where a cached result is reused: within the episode that made "
        "it (safe for tools bound to per-episode state), or across the run (stateless tools)")
    max_concurrency: int | None = Field(None, ge=1, description="calls of this tool at once")

    @model_validator(mode="after")
    def _scope_needs_cache(self) -> ToolPolicy:
        if self.cache_scope == "run" and not self.cache:  # (a dumped config says "episode")
            raise ValueError("cache_scope only applies with cache: true")
        return self


class ExecutorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default: ToolPolicy = Field(ToolPolicy(), description="the policy of every tool without "
                                "its own entry in tools")
    tools: dict[str, ToolPolicy] = Field(default_factory=dict, description="per-tool overrides")
    max_concurrency: int | None = Field(None, ge=1, description="calls of all tools at once")
    cache_size: int = Field(10_000, ge=1, description="cached results kept (least recent out)")
    seed: int = Field(0, description="seeds the backoff jitter")

    def policy(self, name: str) -> ToolPolicy:
        override = self.tools.get(name)
        if override is None:
            return self.default
        written = override.model_dump(include=override.model_fields_set)
        return self.default.model_copy(update=written)


@dataclass(frozen=True)
class ExecutedResult(ToolResult):
    """A `ToolResult` with how it came about. `attempts` is 0 for a cache hit; `timed_out`
    says whether the last attempt hit the timeout."""

    attempts: int = 1
    timed_out: bool = False
    cached: bool = False


@dataclass
class ToolCounters:
    calls: int = 0
    ok: int = 0
    tool_error: int = 0
    env_error: int = 0
    retries: int = 0
    timeouts: int = 0
    cache_hits: int = 0
    peak_concurrency: int = 0  # most calls of the tool running at once (a maximum, not a sum)


def _slots(limit: int | None) -> asyncio.Semaphore | nullcontext:
    return asyncio.Semaphore(limit) if limit else nullcontext()


class ToolExecutor:
    """Runs calls through `target` (a registry or any invoke callable, e.g. a fault injector)
    with `invoke`, or through other targets with the invoke callables `bind` returns; all of
    them share the limits, the cache and the counters.

    asyncio semaphores belong to the loop that first waits on them, and a run starts a fresh
    loop per phase (`asyncio.run`), so the limits are rebuilt when the running loop changes:
    one executor serves successive loops, one at a time (two at once is an error).
    A timed-out sync tool is abandoned, not stopped: its worker thread runs to the end in the
    background (Python cannot kill a thread), so give sync tools their own deadlines too.
    """

    def __init__(self, target: ToolRegistry | Invoke | None = None,
                 config: ExecutorConfig | None = None, tool_names: Iterable[str] | None = None):
        self.inner = as_invoke(target) if target is not None else None
        self.config = config or ExecutorConfig()
        # Names the model invents would each get their own counters and metrics; with the tool
        # names known (always, for a registry), they are pooled under one bucket.
        if tool_names is None and isinstance(target, ToolRegistry):
            tool_names = target.tools
        self.tool_names = set(tool_names) if tool_names is not None else None
        self.counters: dict[str, ToolCounters] = {}
        self._policies: dict[str, ToolPolicy] = {}
        self._limits: dict[str, asyncio.Semaphore | nullcontext] = {}
        self._global: asyncio.Semaphore | nullcontext = nullcontext()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight = 0  # calls between entering and leaving `_run`, all tools
        self._running: dict[str, int] = {}  # attempts inside the limits, per tool
        # cache key: (scope, tool name, canonical arguments); scope is the episode's, or "run"
        self._cache: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self._pending: dict[tuple[str, str, str], asyncio.Future[None]] = {}  # cached, running
        self._binds = itertools.count()
        self._rng = random.Random(self.config.seed)

    def bind(self, target: ToolRegistry | Invoke, episode: str | None = None) -> Invoke:
        """An invoke callable that runs calls through `target` under this executor: e.g. one
        episode's own registry (stateful tools stay per episode, the limits do not). `episode`
        names the episode for the cache's episode scope (default: one of its own per bind)."""
        if isinstance(target, ToolRegistry):
            self.tool_names = (self.tool_names or set()) | set(target.tools)
        inner = as_invoke(target)
        scope = f"episode:{episode}" if episode is not None else f"bind:{next(self._binds)}"

        async def invoke(call: ToolCall) -> ExecutedResult:
            return await self._run(call, inner, scope)

        return invoke

    def _use_loop(self) -> None:
        """Rebuild the semaphores for a new running loop (they are bound to their first one)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        if self._in_flight:
            raise RuntimeError("ToolExecutor called from a second event loop while calls of "
                               "another are running; use one executor per concurrent loop")
        self._loop = loop
        self._pending = {}  # futures are loop-bound too (and none is pending: nothing in flight)
        self._global = _slots(self.config.max_concurrency)
        self._limits = {name: _slots(p.max_concurrency) for name, p in self._policies.items()}

    def _bucket(self, name: str) -> str:
        if self.tool_names is None or name in self.tool_names:
            return name
        return UNKNOWN_TOOL

    def _setup(self, bucket: str) -> tuple[ToolPolicy, ToolCounters]:
        if bucket not in self._policies:
            policy = self.config.policy(bucket)
            self._policies[bucket] = policy
            self._limits[bucket] = _slots(policy.max_concurrency)
            self.counters[bucket] = ToolCounters()
        return self._policies[bucket], self.counters[bucket]

    async def invoke(self, call: ToolCall) -> ExecutedResult:
        """Run `call` through the executor's own target."""
        if self.inner is None:
            raise TypeError("this ToolExecutor has no target: call it through bind(target)")
        return await self._run(call, self.inner, "own")

    async def _run(self, call: ToolCall, inner: Invoke, scope: str) -> ExecutedResult:
        self._use_loop()
        self._in_flight += 1
        try:
            return await self._execute(call, inner, scope)
        finally:
            self._in_flight -= 1

    async def _execute(self, call: ToolCall, inner: Invoke, scope: str) -> ExecutedResult:
        bucket = self._bucket(call.name)
        policy, counts = self._setup(bucket)
        counts.calls += 1
        key = None
        if policy.cache:
            where = "run" if policy.cache_scope == "run" else scope
            key = (where, call.name, canonical_json(call.arguments))
        while key is not None:
            if key in self._cache:
                self._cache.move_to_end(key)
                counts.cache_hits += 1
                counts.ok += 1
                return ExecutedResult(call, ToolOutcome.OK, self._cache[key], 0.0, attempts=0,
                                      cached=True)
            if key not in self._pending:
                break
            # The identical call is running: wait for it, then look again (a failed one leaves
            # nothing cached, and then this call runs itself). shield: our cancellation must
            # not cancel the others' wait.
            await asyncio.shield(self._pending[key])
        if key is None:
            return await self._call(call, inner, bucket, policy, counts, key)
        done = self._pending[key] = asyncio.get_running_loop().create_future()
        try:
            return await self._call(call, inner, bucket, policy, counts, key)
        finally:
            del self._pending[key]
            done.set_result(None)

    async def _call(self, call: ToolCall, inner: Invoke, bucket: str, policy: ToolPolicy,
                    counts: ToolCounters, key: tuple[str, str, str] | None) -> ExecutedResult:
        """The attempts of one call that the cache did not answer, with retries."""
        start = time.perf_counter()
        attempt = 0
        while True:
            attempt += 1
            result, timed_out = await self._attempt(call, inner, bucket, policy, counts)
            counts.timeouts += timed_out
            if result.outcome is not ToolOutcome.ENV_ERROR or attempt > policy.retries:
                break
            counts.retries += 1
            delay = policy.backoff_s * 2 ** (attempt - 1)
            await asyncio.sleep(delay * self._rng.uniform(1 - policy.jitter, 1 + policy.jitter))

        setattr(counts, result.outcome.value, getattr(counts, result.outcome.value) + 1)
        if key is not None and result.outcome is ToolOutcome.OK:
            self._cache[key] = result.content
            if len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return ExecutedResult(call, result.outcome, result.content, time.perf_counter() - start,
                              attempts=attempt, timed_out=timed_out)

    async def _attempt(self, call: ToolCall, inner: Invoke, bucket: str, policy: ToolPolicy,
                       counts: ToolCounters) -> tuple[ToolResult, bool]:
        """One try under the limits. The timeout starts once a slot is free: waiting for one
        is back-pressure, not the tool's slowness."""
        async with self._limits[bucket], self._global:
            start = time.perf_counter()
            self._running[bucket] = self._running.get(bucket, 0) + 1
            counts.peak_concurrency = max(counts.peak_concurrency, self._running[bucket])
            try:
                return await asyncio.wait_for(inner(call), policy.timeout_s), False
            except asyncio.TimeoutError:
                msg, timed_out = f"{call.name} timed out after {policy.timeout_s:g}s", True
            except Exception as e:  # an invoke callable that broke its never-raise contract
                msg, timed_out = f"{call.name} failed: {type(e).__name__}: {e}", False
            finally:
                self._running[bucket] -= 1
        latency = time.perf_counter() - start
        return ToolResult(call, ToolOutcome.ENV_ERROR, msg, latency), timed_out

    def stats(self, reset: bool = False, prefix: str = "") -> dict[str, float]:
        """Per-tool metrics, e.g. `env_error_rate/calculate` and `{prefix}calls/calculate`;
        `reset` starts a new window (call it once per training step to log per-step figures)."""
        out: dict[str, float] = {}
        for name, c in self.counters.items():
            out[f"{prefix}calls/{name}"] = float(c.calls)
            for outcome in ToolOutcome:
                out[f"{outcome.value}_rate/{name}"] = getattr(c, outcome.value) / max(c.calls, 1)
            for f in ("retries", "timeouts", "cache_hits", "peak_concurrency"):
                out[f"{prefix}{f}/{name}"] = float(getattr(c, f))
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        """Zero the counters: a new window of per-step figures (the cache stays)."""
        for c in self.counters.values():
            for f in fields(c):
                setattr(c, f.name, 0)


# ---------------------------------------------------------------------------------------------
# The reliability gate


class ToolReliabilityError(RuntimeError):
    """A tool succeeds too rarely for its reward to mean anything; the message names it."""


@dataclass
class ProbeReport:
    """Per-tool success of a scripted probe; `ok / total` is the success rate."""

    threshold: float
    total: dict[str, int] = field(default_factory=dict)
    ok: dict[str, int] = field(default_factory=dict)
    first_error: dict[str, str] = field(default_factory=dict)

    def rates(self) -> dict[str, float]:
        return {name: self.ok.get(name, 0) / n for name, n in self.total.items()}

    def failing(self) -> dict[str, float]:
        return {name: r for name, r in self.rates().items() if r < self.threshold}

    def check(self, override: bool = False) -> None:
        """Raise `ToolReliabilityError` if a tool is below the threshold. With `override`,
        log the refusal and go on: for a known-flaky tool you decided to train against."""
        failing = self.failing()
        if not failing:
            return
        msg = f"tools below the reliability threshold {self.threshold:.0%}: " + "; ".join(
            f"{name} succeeded {self.ok.get(name, 0)}/{self.total[name]} ({rate:.1%}), "
            f"first error: {self.first_error.get(name, '?')}"
            for name, rate in sorted(failing.items())
        )
        if not override:
            raise ToolReliabilityError(msg)
        logger.warning("reliability gate overridden: %s", msg)


async def probe_tools(target: ToolRegistry | Invoke, calls: Iterable[ToolCall],
                      threshold: float = 0.95, concurrency: int = 16) -> ProbeReport:
    """Run scripted calls (e.g. the expert's, which are all valid) and measure each tool's
    success rate. Any non-ok outcome counts as a failure: a valid scripted call that gets a
    `tool_error` means the tool or its schema is broken."""
    invoke = as_invoke(target)
    report = ProbeReport(threshold)
    slots = asyncio.Semaphore(concurrency)

    async def one(call: ToolCall) -> ToolResult:
        async with slots:
            return await invoke(call)

    for r in await asyncio.gather(*(one(c) for c in calls)):
        name = r.call.name
        report.total[name] = report.total.get(name, 0) + 1
        if r.outcome is ToolOutcome.OK:
            report.ok[name] = report.ok.get(name, 0) + 1
        else:
            report.first_error.setdefault(name, f"{r.outcome.value}: {r.content}")
    return report
