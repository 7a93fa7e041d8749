"""The viewer's reads of traces.sqlite: pages of episode summaries under filters, one episode
with its per-token arrays, an episode's group, and the run's counts.

Every filter is a SQL condition with bound parameters, and a page is `LIMIT/OFFSET` in SQL,
so a page of a 10,000-episode run costs what the page costs, not what the run costs. Only
summary columns are selected for lists: the per-token blobs and the messages are read for the
one episode (or group) on screen.
"""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass, fields
from typing import Any, Literal

from tiller.observe.traces import ARRAYS, JSON_COLUMNS, SUMMARY_COLUMNS, decode

ORDERS = ("id", "rl_step", "reward", "n_tokens", "n_generated", "tool_calls", "tool_errors")
Order = Literal["id", "rl_step", "reward", "n_tokens", "n_generated", "tool_calls",
                "tool_errors"]


@dataclass(frozen=True)
class EpisodeFilter:
    """What the episode list shows: every field given (not None) must hold."""

    phase: str | None = None  # "rl", "eval_sft", "eval_rl", ...
    status: str | None = None  # completed, truncated, aborted, env_error
    step_min: int | None = None  # rl_step range, inclusive
    step_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    env_error: bool | None = None  # the reward's env_error flag
    tool_errors_min: int | None = None  # 1: episodes with at least one failing tool call
    tokens_min: int | None = None  # episode length (all tokens), inclusive
    tokens_max: int | None = None
    trained: bool | None = None  # whether the trainer's arrays were written for it
    q: str | None = None  # substring of the task id or of the conversation's text

    def where(self) -> tuple[str, list[Any]]:
        """The SQL WHERE clause (empty when nothing is filtered) and its parameters."""
        conds: list[str] = []
        args: list[Any] = []
        exact = {"phase": self.phase, "status": self.status,
                 "env_error": None if self.env_error is None else int(self.env_error)}
        for column, value in exact.items():
            if value is not None:
                conds.append(f"{column} = ?")
                args.append(value)
        bounds = (("rl_step", ">=", self.step_min), ("rl_step", "<=", self.step_max),
                  ("reward", ">=", self.reward_min), ("reward", "<=", self.reward_max),
                  ("tool_errors", ">=", self.tool_errors_min),
                  ("n_tokens", ">=", self.tokens_min), ("n_tokens", "<=", self.tokens_max))
        for column, op, value in bounds:
            if value is not None:
                conds.append(f"{column} {op} ?")
                args.append(value)
        if self.trained is not None:
            conds.append(f"trained_step IS {'NOT ' if self.trained else ''}NULL")
        if self.q:
            # LIKE with an escape character: a user's % or _ is a literal, not a wildcard
            pattern = "%" + self.q.replace("\\", "\\\\").replace("%", "\\%").replace(
                "_", "\\_") + "%"
            conds.append("(task_id LIKE ? ESCAPE '\\' OR messages LIKE ? ESCAPE '\\')")
            args += [pattern, pattern]
        return ("WHERE " + " AND ".join(conds) if conds else ""), args

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


def _summary(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    for c in JSON_COLUMNS:
        if c in out:
            out[c] = json.loads(out[c])
    return out


def page(con: sqlite3.Connection, flt: EpisodeFilter, order: Order = "id",
         descending: bool = False, limit: int = 50, offset: int = 0) -> dict[str, Any]:
    """One page of episode summaries matching `flt`, with the total that match."""
    if order not in ORDERS:
        raise ValueError(f"order: got {order!r}; expected one of {', '.join(ORDERS)}")
    where, args = flt.where()
    direction = "DESC" if descending else "ASC"
    total = con.execute(f"SELECT COUNT(*) FROM episodes {where}", args).fetchone()[0]
    rows = con.execute(f"SELECT {', '.join(SUMMARY_COLUMNS)} FROM episodes {where} "
                       f"ORDER BY {order} {direction}, id {direction} LIMIT ? OFFSET ?",
                       [*args, limit, offset]).fetchall()
    return {"total": total, "offset": offset, "limit": limit, "filter": flt.as_dict(),
            "episodes": [_summary(r) for r in rows]}


def _finite(values: list | None) -> list | None:
    # JSON has no NaN or infinity: such a value is sent as null (and shown as "n/a")
    if values is None:
        return None
    return [v if not isinstance(v, float) or math.isfinite(v) else None for v in values]


def episode(con: sqlite3.Connection, episode_id: int) -> dict[str, Any] | None:
    """Episode `episode_id` whole: its summary, messages, tool calls and per-token arrays
    (None for the trainer's arrays of an episode that was not trained); None if absent."""
    row = con.execute("SELECT * FROM episodes WHERE id = ?", (episode_id,)).fetchone()
    if row is None:
        return None
    out = {k: row[k] for k in row.keys() if k not in ARRAYS}  # noqa: SIM118 (sqlite3.Row)
    for c in JSON_COLUMNS:
        out[c] = json.loads(out[c])
    out["arrays"] = {c: _finite(decode(c, row[c])) for c in ARRAYS}
    calls = con.execute("SELECT turn, idx, name, arguments, result, outcome, latency_s "
                        "FROM tool_calls WHERE episode_id = ? ORDER BY idx", (episode_id,))
    out["tool_calls_list"] = [{**dict(c), "arguments": json.loads(c["arguments"])}
                              for c in calls]
    return out


def group(con: sqlite3.Connection, episode_id: int) -> list[dict[str, Any]] | None:
    """The episodes of `episode_id`'s group, best reward first, each with its messages and
    tool calls. RL: the episodes sampled together with it (the same tag, task and draw: one
    group, trained or filtered together, with those of its members the buffer dropped), even
    when, in async, they ended in different steps. Eval: every sample of its task's draw,
    under every eval seed. None if there is no such episode."""
    key = con.execute("SELECT phase, tag, task_id, draw FROM episodes WHERE id = ?",
                      (episode_id,)).fetchone()
    if key is None:
        return None
    # draws are counted per tag: in RL another unit (or refill round) that drew the same task
    # has draw 0 too. An eval unit is (task, draw) pooled over eval.seeds, whose tags differ.
    same, args = "phase = ? AND task_id = ? AND draw = ?", [key["phase"], key["task_id"],
                                                            key["draw"]]
    if key["phase"] == "rl":
        same += " AND tag = ?"
        args.append(key["tag"])
    cols = [*SUMMARY_COLUMNS, "messages"]
    rows = con.execute(f"SELECT {', '.join(cols)} FROM episodes WHERE {same} "
                       f"ORDER BY reward DESC, sample_index, id", args).fetchall()
    members = [_summary(r) for r in rows]
    ids = [m["id"] for m in members]
    calls: dict[int, list[dict[str, Any]]] = {i: [] for i in ids}
    for c in con.execute(f"SELECT episode_id, turn, idx, name, arguments, result, outcome "
                         f"FROM tool_calls WHERE episode_id IN ({', '.join('?' * len(ids))}) "
                         f"ORDER BY episode_id, idx", ids):
        calls[c["episode_id"]].append({**dict(c), "arguments": json.loads(c["arguments"])})
    for m in members:
        m["tool_calls_list"] = calls[m["id"]]
    return members


def overview(con: sqlite3.Connection) -> dict[str, Any]:
    """The counts the list page's filters offer: episodes by phase and by status, the RL step
    range, and the database's meta rows."""
    def counts(column: str) -> dict[str, int]:
        return {r[0]: r[1] for r in con.execute(
            f"SELECT {column}, COUNT(*) FROM episodes GROUP BY {column} ORDER BY {column}")}

    lo, hi = con.execute("SELECT MIN(rl_step), MAX(rl_step) FROM episodes").fetchone()
    meta = {r["key"]: json.loads(r["value"]) for r in con.execute("SELECT key, value FROM meta")}
    return {"phases": counts("phase"), "statuses": counts("status"),
            "total": con.execute("SELECT COUNT(*) FROM episodes").fetchone()[0],
            "rl_steps": [lo, hi], "meta": meta}
