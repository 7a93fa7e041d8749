"""Fault injection: make tools hang, crash or return garbage, with seeded probabilities.

A policy trained only against perfect tools learns nothing about failures it will meet in
deployment, and the retry, timeout and env-error paths of the harness never run. The injector
wraps tools so that a configured share of calls fails the way real tools fail:

- `timeout`: the tool hangs for `hang_s` (the executor's timeout cuts it short, as it would a
  stuck service) and then raises `TimeoutError`;
- `crash`: the tool raises `InjectedFault`, which the registry reports as an `env_error` (an
  unclassified exception: see `Tool.blame`);
- `garbage`: the tool returns a random string, an `ok` result with useless content (a
  truncated page, a corrupted response: nothing tells the policy it is wrong).

A call that does not fail can still be slow: `latency_s` for every call and `slow_s` for a
`slow_prob` share of them, a heavy-tailed latency like real agent tools (the asynchronous
schedule exists because of it). The wait is a sleep, so it costs no CPU.

Faults are injected into the tool, behind the registry's argument validation, so a call with
bad arguments is still the policy's `tool_error` and an injected fault is reported exactly like
a real one. Compose with the executor as `ToolExecutor(injector.wrap(registry), config)`.

Whether a call fails is drawn from an RNG keyed by (seed, key, tool, canonical arguments,
occurrence), not from one shared stream, so the decisions do not depend on how concurrent
episodes interleave. `occurrence` counts identical calls under one key: with one shared wrap,
only which of several episodes making the identical call at once gets which draw depends on
scheduling; wrapping per episode with its own key (task id and seed) removes even that.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import string
from collections import Counter
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tiller.tools.executor import canonical_json
from tiller.tools.registry import Tool, ToolRegistry

FAULTS = ("timeout", "crash", "garbage")


class InjectedFault(Exception):
    """The crash the injector raises; the registry maps it to `env_error`."""


class FaultConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_prob: float = Field(0.0, ge=0, le=1, description="share of calls that hang for "
                                "hang_s (the executor's timeout cuts them) and fail with a "
                                "timeout")
    crash_prob: float = Field(0.0, ge=0, le=1, description="share of calls that raise: an "
                              "env_error")
    garbage_prob: float = Field(0.0, ge=0, le=1, description="share of calls that return a "
                                "random string as an ok result")
    hang_s: float = Field(60.0, ge=0, description="how long an injected timeout hangs")
    latency_s: float = Field(0.0, ge=0, description="every call that does not fail sleeps this "
                             "long first (a slow service; sleeping costs no CPU)")
    slow_prob: float = Field(0.0, ge=0, le=1, description="share of those calls that sleep "
                             "slow_s instead: a heavy-tailed latency, as agent tools have")
    slow_s: float = Field(0.0, ge=0, description="the latency of a slow call")
    seed: int = Field(0, description="seeds which calls fail (drawn per call, so it does not "
                      "depend on how episodes interleave)")
    tools: list[str] | None = Field(None, description="tools to inject into; None = all")

    @model_validator(mode="after")
    def _at_most_one(self) -> FaultConfig:
        if self.timeout_prob + self.crash_prob + self.garbage_prob > 1:
            raise ValueError("timeout_prob + crash_prob + garbage_prob must be at most 1")
        return self


class FaultInjector:
    """Wraps tools with seeded faults; `injected` counts them as `"crash/calculate"` etc."""

    def __init__(self, config: FaultConfig):
        self.config = config
        self.injected: Counter[str] = Counter()
        self._occurrences: Counter[tuple[str, str, str]] = Counter()

    def draw(
        self, name: str, arguments: dict[str, Any], key: str = ""
    ) -> tuple[str | None, random.Random]:
        """The fault for this call (None for a clean call), and its RNG for the garbage."""
        args = canonical_json(arguments)
        occurrence = self._occurrences[key, name, args]
        self._occurrences[key, name, args] += 1
        seed = f"{self.config.seed}|{key}|{name}|{args}|{occurrence}"
        rng = random.Random(hashlib.sha256(seed.encode()).digest())
        u, edge = rng.random(), 0.0
        for fault in FAULTS:
            edge += getattr(self.config, f"{fault}_prob")
            if u < edge:
                self.injected[f"{fault}/{name}"] += 1
                return fault, rng
        return None, rng

    def delay(self, rng: random.Random, name: str) -> float:
        """The latency of a call that does not fail: slow_s with probability slow_prob, else
        latency_s (drawn from the call's own RNG, so it is seeded like the faults)."""
        c = self.config
        slow = c.slow_prob > 0 and rng.random() < c.slow_prob
        if slow:
            self.injected[f"slow/{name}"] += 1
        return c.slow_s if slow else c.latency_s

    def wrap_tool(self, t: Tool, key: str = "") -> Tool:
        """The same tool (name, schema, validation) with faults injected into its function."""
        if self.config.tools is not None and t.name not in self.config.tools:
            return t

        async def faulty(**arguments: Any) -> Any:
            fault, rng = self.draw(t.name, arguments, key)
            if fault == "timeout":
                await asyncio.sleep(self.config.hang_s)
                raise TimeoutError(f"injected hang of {self.config.hang_s:g}s")
            if fault == "crash":
                raise InjectedFault("injected crash")
            if fault == "garbage":
                return "".join(rng.choices(string.printable, k=rng.randint(1, 64)))
            delay = self.delay(rng, t.name)
            if delay > 0:
                await asyncio.sleep(delay)
            return await t(**arguments)

        return replace(t, fn=faulty)  # the same name, schema, validation and blame rule

    def wrap(self, registry: ToolRegistry, key: str = "") -> ToolRegistry:
        """A registry of the same tools with faults; pass it (or its `.invoke`) on."""
        return ToolRegistry(self.wrap_tool(t, key) for t in registry.tools.values())
