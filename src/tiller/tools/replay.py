"""Record and replay tool calls: a SQLite file of every call's input and output.

Live tools drift (a search index changes, an API goes down, a clock moves), so two evaluations
of the same checkpoint can differ for reasons that have nothing to do with the policy.
Recording the calls once and replaying them makes environment behaviour a fixed input: evals
become reproducible, debugging a bad episode replays exactly what the policy saw, and tests
run without the network.

A call is identified by (key, tool name, canonical arguments, occurrence). `key` names the
episode (task id, seed, sample index); `occurrence` counts identical calls within one wrapped
invoke, so a non-deterministic tool called twice with the same arguments replays its two
different answers in order. Each `wrap` is one episode: its occurrences start again at 0.

A replay miss (a call the store has never seen, e.g. because the policy did something new) is
returned as an `env_error` result naming the tool, arguments, key and occurrence, rather than
raised: the episode goes on, the miss counts as an env error like any other environment
failure, and `ReplayStore.misses` counts them for a strict check after the run.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Literal

from tiller.files import refuse_sqlite_links
from tiller.tools.executor import Invoke, as_invoke, canonical_json
from tiller.tools.registry import ToolCall, ToolOutcome, ToolRegistry, ToolResult

ReplayMode = Literal["record", "replay", "replay_or_live"]
MODES: tuple[str, ...] = ("record", "replay", "replay_or_live")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    key TEXT NOT NULL,
    tool TEXT NOT NULL,
    arguments TEXT NOT NULL,
    occurrence INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    content TEXT NOT NULL,
    latency_s REAL NOT NULL,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (key, tool, arguments, occurrence)
)
"""
# what a replay needs besides the calls, e.g. an MCP server's tool listing (tiller.tools.mcp)
_META = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"


class ReplayStore:
    """A SQLite file of tool calls, shared by every episode of a run.

    - `record`: call the live tool and store the result (re-recording a key overwrites it);
    - `replay`: serve results from the store only; the live tool is never called;
    - `replay_or_live`: serve what the store has, call the live tool for the rest and record it.

    One connection guarded by a lock serves all episodes (statements take microseconds, so
    running them on the event loop is cheaper than a thread hop); WAL mode lets other
    processes read the file while a run writes it.
    """

    def __init__(self, path: str | Path, mode: ReplayMode = "record"):
        if mode not in MODES:
            raise ValueError(f"replay mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.path, self.mode = Path(path), mode
        self.misses = 0
        self._lock = threading.Lock()
        refuse_sqlite_links(self.path)  # SQLite writes in place
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.execute(_SCHEMA)
        self._conn.execute(_META)

    def wrap(self, target: ToolRegistry | Invoke, key: str = "") -> Invoke:
        """An invoke callable for one episode. Wrap outside the executor (`store.wrap(
        executor.invoke, key)`) to record what the policy saw, after retries and timeouts."""
        live = as_invoke(target)
        seen: Counter[tuple[str, str]] = Counter()

        async def invoke(call: ToolCall) -> ToolResult:
            args = canonical_json(call.arguments)
            occurrence = seen[call.name, args]
            seen[call.name, args] += 1  # before any await, so concurrent calls get distinct ones
            where = (key, call.name, args, occurrence)
            if self.mode != "record":
                start = time.perf_counter()
                row = self._get(where)
                if row is not None:
                    return ToolResult(call, ToolOutcome(row[0]), row[1],
                                      time.perf_counter() - start)
                if self.mode == "replay":
                    self.misses += 1
                    msg = (f"replay miss: no recorded result for {call.name}({args}) "
                           f"(occurrence {occurrence}, key {key!r}) in {self.path}")
                    return ToolResult(call, ToolOutcome.ENV_ERROR, msg,
                                      time.perf_counter() - start)
            result = await live(call)
            self._put(where, result)
            return result

        return invoke

    def _get(self, where: tuple[str, str, str, int]) -> tuple[str, str] | None:
        with self._lock:
            return self._conn.execute(
                "SELECT outcome, content FROM calls "
                "WHERE key = ? AND tool = ? AND arguments = ? AND occurrence = ?", where,
            ).fetchone()

    def _put(self, where: tuple[str, str, str, int], result: ToolResult) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO calls VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (*where, result.outcome.value, result.content, result.latency_s, time.time()),
            )

    def put_meta(self, key: str, value: str) -> None:
        """Record `value` under `key` (overwriting), for a later replay to read."""
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> ReplayStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
