"""The tool stack of a run: fault injection -> executor -> record/replay.

Each episode's environment hands its own `ToolRegistry` to `ToolStack.wrapper(key)`, which
wraps it (inside out) with the fault injector, the run's one `ToolExecutor` (`bind`) and the
replay store, so that stateful tools (a per-episode database) work as well as shared ones,
while the executor's concurrency limits, cache and counters span every episode of the run.
Its counters become per-tool metrics (`env_error_rate/<tool>`) and, before training, the
reliability gate's report.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tiller.errors import ConfigError
from tiller.files import folder_below
from tiller.tools.executor import ExecutorConfig, Invoke, ProbeReport, ToolExecutor
from tiller.tools.faults import FaultConfig, FaultInjector
from tiller.tools.mcp import McpServerConfig, McpTools
from tiller.tools.registry import (
    Tool,
    ToolCall,
    ToolOutcome,
    ToolRegistry,
    ToolResult,
    load_tools,
)
from tiller.tools.replay import ReplayStore
from tiller.tools.threads import abandoned_threads


class ReplayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="SQLite file; a relative path is relative to the run "
                      "folder (a link among its folders there is refused); one that leaves "
                      "it (absolute, or with ..) is used as written")
    mode: Literal["record", "replay", "replay_or_live"] = Field(
        "record", description="record: call the live tools and store every call; replay: "
        "answer only from the file (a call it lacks is an env_error); replay_or_live: the "
        "file where it has the call, the live tool (recorded) otherwise")


class GateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="before training, run the scripted expert and "
                          "check its tool calls (skipped in replay mode and for an env without "
                          "an expert)")
    threshold: float = Field(0.95, ge=0.0, le=1.0, description="share of each tool's expert "
                             "calls that must succeed; below it the run stops before training "
                             "(unless override)")
    probe_tasks: int = Field(16, ge=1, description="expert episodes the probe runs")
    override: bool = Field(False, description="train anyway below the threshold (logged)")


class SandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    allow_unsafe_fallback: bool = Field(
        False, description="let envs that run model-written code (code env, unit-test "
        "verifiers) run it UNSANDBOXED when bubblewrap does not work; otherwise they refuse")


class ToolsConfig(BaseModel):
    """`env.tools`: extra tool functions and the stack every tool call goes through. A YAML
    list (`env.tools: [mypkg.tools:search]`) is short for `env.tools: {functions: [...]}`."""

    model_config = ConfigDict(extra="forbid")
    functions: list[str] = Field(
        default_factory=list, description="dotted paths (package.module:name) of tool "
        "functions (typed, Google-style docstring) or @tool objects, added to the env's own "
        "tools in every episode; only a ToolEnv takes them")
    mcp: list[McpServerConfig] = Field(
        default_factory=list, description="MCP servers whose tools every episode gets, "
        "through this same stack (tiller.tools.mcp; pip install 'tiller[mcp]'): each "
        "{name, command: [argv]} (stdio, started once per run) or {name, url} (streamable HTTP)")
    executor: ExecutorConfig = Field(ExecutorConfig(), description="timeouts, retries, "
                                     "caching and concurrency of tool calls")
    faults: FaultConfig | None = Field(None, description="seeded tool failures and latency "
                                       "(docs/tools.md); null: none")
    replay: ReplayConfig | None = Field(None, description="record tool calls to a SQLite file "
                                        "or replay them from it; null: live tools, nothing "
                                        "recorded")
    gate: GateConfig = Field(GateConfig(), description="the tool reliability gate before "
                             "training")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig,
                                   description="running model-written code")

    @model_validator(mode="before")
    @classmethod
    def _list_is_functions(cls, data: Any) -> Any:
        return {"functions": data} if isinstance(data, list) else data


class ToolStack:
    def __init__(self, cfg: ToolsConfig, run_dir: Path):
        self.cfg = cfg
        self.injector = FaultInjector(cfg.faults) if cfg.faults else None
        self.store = None
        if cfg.replay is not None:
            path = _replay_location(Path(cfg.replay.path), run_dir)
            self.store = ReplayStore(_replay_path(path, cfg.replay.mode), cfg.replay.mode)
        self.functions = load_tools(cfg.functions)  # before any work: a bad path is one line
        self.mcp = None
        if cfg.mcp:  # started (or, replaying, read from the file) now: a bad server is one line
            try:
                self.mcp = McpTools(cfg.mcp, run_dir, self.store)
                _check_unique(self.functions, self.mcp.tools)
            except BaseException:
                self.close()
                raise
        self.mcp_tools = self.mcp.tools if self.mcp else []
        self.extra = [*self.functions, *self.mcp_tools]  # every episode's registry gets them
        self.executor = ToolExecutor(config=cfg.executor)
        self.first_error: dict[str, str] = {}
        # totals of the counters outside the executor; abandoned threads are process-wide, so
        # this run counts from its own start
        self._window_start: dict[str, int] = {"tool_abandoned_threads": abandoned_threads()}

    def wrapper(self, key: str) -> Callable[[ToolRegistry], Invoke]:
        """What an environment calls with its registry; `key` names the episode (replay and
        fault draws are keyed by it, so they do not depend on scheduling). The registry gets
        the run's `env.tools.functions` first, so they go through the same stack."""

        def wrap(registry: ToolRegistry) -> Invoke:
            registry.extend(self.extra)  # the env's own, `env.tools.functions`, MCP tools
            target = registry if self.injector is None else self.injector.wrap(registry, key)
            invoke = self.executor.bind(target, episode=key)
            if self.store is not None:  # (an empty store is falsy: it has a __len__)
                invoke = self.store.wrap(invoke, key)

            async def noted(call: ToolCall) -> ToolResult:
                result = await invoke(call)
                if result.outcome is not ToolOutcome.OK:
                    self.first_error.setdefault(call.name, f"{result.outcome.value}: "
                                                           f"{result.content}")
                return result

            return noted

        return wrap

    def stats(self, reset: bool = True) -> dict[str, float]:
        """Per-tool rates and counts over the episodes since the last reset."""
        out = self.executor.stats(reset=reset, prefix="tool_")
        # Counters outside the executor, as counts since the last reset like the rest.
        totals = {"tool_abandoned_threads": abandoned_threads()}
        if self.store is not None:
            totals["replay_misses"] = self.store.misses
        if self.mcp is not None:
            totals.update({f"mcp_restarts/{n}": k for n, k in self.mcp.restarts().items()})
            totals.update({f"mcp_truncated/{n}": k for n, k in self.mcp.truncated.items()})
        for name, total in totals.items():
            out[name] = float(total - self._window_start.get(name, 0))
            if reset:
                self._window_start[name] = total
        return out

    def probe_report(self) -> ProbeReport:
        """The gate's view of the episodes so far: every scripted call should succeed."""
        report = ProbeReport(self.cfg.gate.threshold)
        for name, c in self.executor.counters.items():
            report.total[name] = c.calls
            report.ok[name] = c.ok
            if name in self.first_error:
                report.first_error[name] = self.first_error[name]
        return report

    def close(self) -> None:
        try:
            if self.mcp is not None:
                self.mcp.close()  # every server stopped
        finally:
            if self.store is not None:
                self.store.close()


RATES = tuple(f"{o.value}_rate" for o in ToolOutcome)  # `ToolExecutor.stats`'s rate keys


def merged_stats(per: list[dict[str, float]]) -> dict[str, float]:
    """Several tool stacks' `ToolStack.stats` as one stack's (the run's and its Ray rollout
    workers'): counts summed, `tool_peak_concurrency/<tool>` the largest of one stack's, the
    outcome rates weighted by each stack's calls of the tool."""
    out: dict[str, float] = {}
    for s in per:
        for k, v in s.items():
            kind, _, tool = k.partition("/")
            if kind == "tool_peak_concurrency":
                out[k] = max(out.get(k, 0.0), v)
            elif kind in RATES:
                out[k] = out.get(k, 0.0) + v * s[f"tool_calls/{tool}"]
            else:
                out[k] = out.get(k, 0.0) + v
    for k in out:
        kind, _, tool = k.partition("/")
        if kind in RATES:
            out[k] /= max(out[f"tool_calls/{tool}"], 1.0)
    return out


def _check_unique(functions: list[Tool], mcp: list[Tool]) -> None:
    clash = sorted({t.name for t in functions} & {t.name for t in mcp})
    if clash:
        raise ConfigError(f"config field env.tools.mcp: tool name(s) {', '.join(clash)} are "
                          "also env.tools.functions; tool names must be unique")


def _replay_location(path: Path, run_dir: Path) -> Path:
    """Where a replay path points: a relative one is relative to the run folder. Inside the
    run folder, no folder on the way below it may be a link (`folder_below`); a path the user
    wrote to leave it (absolute, or with `..`) is theirs to choose and is used as written."""
    if path.is_absolute():
        return path
    full = Path(os.path.abspath(run_dir / path))
    inside = Path(os.path.abspath(run_dir)) in full.parents
    return folder_below(run_dir, full.parent, make=False) / full.name if inside else full


def _replay_path(path: Path, mode: str) -> Path:
    """The replay file, checked before any work: SQLite would fail on a missing folder with a
    traceback, and would quietly create an empty file to replay (every call a miss)."""
    where = "config field env.tools.replay.path"
    if not path.parent.is_dir():
        raise ConfigError(f"{where}: got {str(path)!r}; the folder {str(path.parent)!r} does "
                          "not exist (create it, or use a path relative to the run folder)")
    if mode == "replay" and not path.is_file():
        raise ConfigError(f"{where}: got {str(path)!r}; mode 'replay' needs a recorded file "
                          "(record one with mode 'record')")
    return path
