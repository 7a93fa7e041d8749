"""Token-level traces: a run's episodes, token by token, in `traces.sqlite` (docs/traces.md).

Metrics say that something went wrong; a trace shows where: the tokens, the loss mask, the
engine's and the trainer's logprobs, the advantages, the tool calls and the reward's checks
of each episode, and the ledger of each step. `TraceWriter` writes them from a background
thread, so training never waits on SQLite: the training side only puts references to the
(immutable) trajectories and tensors on a bounded queue, and the writer encodes and commits
them. The database is in WAL mode and each batch of writes is one committed transaction, so a
run killed at any point (SIGKILL) leaves a readable file holding every batch committed before.

Per-token arrays are packed little-endian blobs, one value per token (`ARRAYS` gives each
column's numpy dtype); `read_episode` and `query` are the reader's side.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tiller.errors import RunError, RunFolderError
from tiller.files import refuse_sqlite_links
from tiller.seeds import derive_seed

if TYPE_CHECKING:  # the readers (tiller view, tiller report) never load torch
    import torch

    from tiller.rollout.trajectory import Trajectory
    from tiller.train.batch import Batch
    from tiller.train.trainer import RLStepTensors

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: draw and tag (an episode's group), at_end

# numpy dtype of each per-token blob column (little-endian, one value per token)
ARRAYS = {"token_ids": "<i4", "loss_mask": "u1", "logprobs": "<f8", "token_versions": "<i4",
          "train_mask": "u1", "trainer_logprobs": "<f4", "advantages": "<f4"}
# columns holding JSON text
JSON_COLUMNS = ("tag", "checks", "versions", "turn_spans", "segment_starts", "split_reasons",
                "timings", "info", "messages")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS episodes (
    id INTEGER PRIMARY KEY,
    phase TEXT NOT NULL,
    split TEXT NOT NULL,
    rl_step INTEGER,
    at_end INTEGER NOT NULL,
    global_step INTEGER NOT NULL,
    task_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    draw INTEGER NOT NULL,
    tag TEXT NOT NULL,
    seed INTEGER,
    status TEXT NOT NULL,
    reward REAL NOT NULL,
    checks TEXT NOT NULL,
    env_error INTEGER NOT NULL,
    min_version INTEGER,
    max_version INTEGER,
    versions TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    n_generated INTEGER NOT NULL,
    n_turns INTEGER NOT NULL,
    prompt_len INTEGER NOT NULL,
    tool_calls INTEGER NOT NULL,
    tool_errors INTEGER NOT NULL,
    env_errors INTEGER NOT NULL,
    parse_errors INTEGER NOT NULL,
    tool_outputs_truncated INTEGER NOT NULL,
    discarded_tokens INTEGER NOT NULL,
    turn_spans TEXT NOT NULL,
    segment_starts TEXT NOT NULL,
    split_reasons TEXT NOT NULL,
    timings TEXT NOT NULL,
    info TEXT NOT NULL,
    messages TEXT NOT NULL,
    token_ids BLOB NOT NULL,
    loss_mask BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    token_versions BLOB NOT NULL,
    trained_step INTEGER,
    train_mask BLOB,
    trainer_logprobs BLOB,
    advantages BLOB,
    written REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS episodes_phase_step ON episodes (phase, rl_step);
CREATE INDEX IF NOT EXISTS episodes_status ON episodes (status);
CREATE INDEX IF NOT EXISTS episodes_reward ON episodes (reward);
CREATE INDEX IF NOT EXISTS episodes_split ON episodes (split);
CREATE INDEX IF NOT EXISTS episodes_task ON episodes (task_id);
CREATE INDEX IF NOT EXISTS episodes_seed ON episodes (phase, seed);
CREATE INDEX IF NOT EXISTS episodes_trained ON episodes (trained_step);
CREATE TABLE IF NOT EXISTS tool_calls (
    id INTEGER PRIMARY KEY,
    episode_id INTEGER NOT NULL REFERENCES episodes (id),
    turn INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    name TEXT NOT NULL,
    arguments TEXT NOT NULL,
    result TEXT NOT NULL,
    outcome TEXT NOT NULL,
    latency_s REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tool_calls_episode ON tool_calls (episode_id);
CREATE INDEX IF NOT EXISTS tool_calls_name ON tool_calls (name, outcome);
CREATE TABLE IF NOT EXISTS steps (
    rl_step INTEGER PRIMARY KEY,
    global_step INTEGER NOT NULL,
    time REAL NOT NULL,
    ledger TEXT NOT NULL
);
"""

_EPISODE_COLUMNS = (
    "phase", "split", "rl_step", "at_end", "global_step", "task_id", "sample_index", "draw",
    "tag", "seed", "status", "reward", "checks", "env_error", "min_version", "max_version",
    "versions", "n_tokens", "n_generated", "n_turns", "prompt_len", "tool_calls",
    "tool_errors", "env_errors", "parse_errors", "tool_outputs_truncated", "discarded_tokens",
    "turn_spans", "segment_starts", "split_reasons", "timings", "info", "messages",
    "token_ids", "loss_mask", "logprobs", "token_versions", "written")
_INSERT_EPISODE = (f"INSERT INTO episodes ({', '.join(_EPISODE_COLUMNS)}) "
                   f"VALUES ({', '.join('?' * len(_EPISODE_COLUMNS))})")
# what `query` returns per episode: everything but the per-token arrays and the messages
SUMMARY_COLUMNS = ("id", *(c for c in _EPISODE_COLUMNS if c not in ARRAYS and c != "messages"),
                   "trained_step")
_ORDER_BY = ("id", "rl_step", "reward", "n_tokens", "n_generated", "global_step")


def _pack(values: Sequence[float] | np.ndarray, column: str) -> bytes:
    return np.asarray(values, dtype=ARRAYS[column]).tobytes()


def _json(value: Any) -> str:
    # default=repr: a trace shows an odd object (a user env's message payload) as its repr
    # rather than failing the run
    return json.dumps(value, default=repr)


def _episode_row(traj: Trajectory, phase: str, split: str, global_step: int,
                 rl_step: int | None) -> tuple:
    # token_versions is empty for a trajectory built without them: the turns' versions then
    generated = [v for v, m in zip(traj.token_versions, traj.loss_mask, strict=False) if m]
    generated = generated or list(traj.versions)
    row = {
        "phase": phase, "split": split, "rl_step": rl_step, "at_end": 0,
        "global_step": global_step,
        "task_id": traj.task_id, "sample_index": traj.sample_index, "draw": traj.draw,
        "tag": _json(list(traj.tag)), "seed": traj.seed,
        "status": traj.status.value, "reward": traj.reward.value,
        "checks": _json(dict(traj.reward.checks)), "env_error": int(traj.reward.env_error),
        "min_version": min(generated, default=None), "max_version": max(generated, default=None),
        "versions": _json(list(traj.versions)), "n_tokens": len(traj.token_ids),
        "n_generated": traj.num_generated, "n_turns": traj.num_turns,
        "prompt_len": traj.prompt_len, "tool_calls": traj.tool_calls,
        "tool_errors": traj.tool_errors, "env_errors": traj.env_errors,
        "parse_errors": traj.parse_errors, "discarded_tokens": traj.discarded_tokens,
        "tool_outputs_truncated": traj.tool_outputs_truncated,
        "turn_spans": _json([list(s) for s in traj.turn_spans]),
        "segment_starts": _json(list(traj.segment_starts)),
        "split_reasons": _json(list(traj.split_reasons)),
        "timings": _json(dict(traj.timings)), "info": _json(dict(traj.info)),
        "messages": _json(list(traj.messages)),
        "token_ids": _pack(traj.token_ids, "token_ids"),
        "loss_mask": _pack(traj.loss_mask, "loss_mask"),
        "logprobs": _pack(traj.logprobs, "logprobs"),
        "token_versions": _pack(traj.token_versions, "token_versions"),
        "written": time.time(),
    }
    return tuple(row[c] for c in _EPISODE_COLUMNS)


def _payload_bytes(row: Sequence[Any]) -> int:
    return sum(len(v) for v in row if isinstance(v, (bytes, str)))


def _stored_bytes(con: sqlite3.Connection) -> int:
    """The payload already in the file, as `_payload_bytes` counted it (text and blobs)."""
    total = 0
    for table in ("episodes", "tool_calls"):
        cols = [c for _, c, *_ in con.execute(f"PRAGMA table_info({table})")]
        size = " + ".join(f"iif(typeof({c}) IN ('text', 'blob'), length({c}), 0)" for c in cols)
        total += con.execute(f"SELECT COALESCE(SUM({size}), 0) FROM {table}").fetchone()[0]
    return total


def _timed(put: Callable[..., None]) -> Callable[..., None]:
    """A TraceWriter put, its caller's time inside it added to `_put_s` (traces/put_s)."""
    @functools.wraps(put)
    def timed(self: TraceWriter, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            put(self, *args, **kwargs)
        finally:
            self._put_s += time.perf_counter() - t0
    return timed


class TraceWriter:
    """Writes `path` (traces.sqlite) from a background thread.

    put_episode   an episode (RL ones sampled by `sample_rate`, eval ones always)
    put_training  what the trainer computed for a batch: updates its episodes' rows
    put_ledger    one RL step's ledger
    put_at_end    marks the RL episodes the end of RL left untrained
    stats         the `traces/*` counters, cumulative: nothing is skipped without a count
    close         drains the queue (at most `close_timeout_s`), then closes the database

    A full queue never slows training: RL items are dropped and counted (traces/dropped_queue);
    an eval episode waits for room, at most `close_timeout_s`. `max_mb` caps the payload
    (arrays, JSON, tool calls): RL episodes past it are dropped and counted
    (traces/dropped_cap); eval episodes are written anyway (traces/eval_over_cap), so eval
    alone can take the file past the cap, by at most its eval.tasks x samples_per_task
    episodes per evaluation. The trainer's arrays of an episode already written are written
    too (at most twice the episode's token arrays). Sampling draws no random numbers: a hash
    of the episode's seed decides, so training is the same with traces on or off.
    """

    def __init__(self, path: str | Path, sample_rate: float = 1.0,
                 max_mb: float | None = None, seed: int = 0, queue_size: int = 1024,
                 close_timeout_s: float = 120.0):
        self.path = Path(path)
        self.sample_rate, self.seed = sample_rate, seed
        self.max_bytes = None if max_mb is None else int(max_mb * 2**20)
        self.close_timeout_s = close_timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("written", "sampled_out", "dropped_cap", "dropped_queue",
                                      "eval_over_cap", "trained", "steps", "at_end"), 0)
        self._cpu_s = 0.0  # the writer thread's CPU time so far: what tracing costs
        self._put_s = 0.0  # the callers' time inside put_*: what tracing costs the trainer
        # seed -> row id of the RL episodes this writer wrote (writer thread only): training
        # updates and at_end marks touch these rows, never those of an earlier run's file
        self._rl_rows: dict[int, int] = {}
        self._error: BaseException | None = None
        self._closed = False
        refuse_sqlite_links(self.path)  # SQLite writes in place
        # the schema exists before the first put returns: a reader never sees a bare file
        con = self._connect()
        try:
            found = schema_version(con)
            if found not in (None, SCHEMA_VERSION):  # an older run's file in this folder
                raise RunError(f"traces: {self.path} holds traces of schema version {found}; "
                               f"this tiller writes version {SCHEMA_VERSION}: use a new "
                               f"output folder (or move the file away)")
            meta = {"schema_version": SCHEMA_VERSION, "arrays": ARRAYS,
                    "sample_rate": sample_rate, "max_mb": max_mb, "created": time.time()}
            # one transaction: a reader (or a kill) never finds the tables without the version
            con.execute("BEGIN")
            for statement in filter(str.strip, SCHEMA.split(";")):
                con.execute(statement)
            con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                            [(k, json.dumps(v)) for k, v in meta.items()])
            con.execute("COMMIT")
            # max_mb caps the file: what it holds (a resumed run's) counts from the start
            self._bytes = _stored_bytes(con) if self.max_bytes is not None else 0
        finally:
            con.close()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tiller-traces")
        self._thread.start()

    def _connect(self) -> sqlite3.Connection:
        # autocommit: the writer opens its own transactions (`_write_batch`)
        con = sqlite3.connect(self.path, isolation_level=None)
        # WAL: a killed writer leaves the committed transactions readable; NORMAL sync is
        # durable against a killed process (only a power loss can lose the last commits)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        return con

    # ------------------------------------------------------------------ the training side
    @_timed
    def put_episode(self, traj: Trajectory, phase: str, split: str, global_step: int,
                    rl_step: int | None = None) -> None:
        """Queue one episode. `phase` is the metrics.jsonl phase ("rl", "eval_sft", ...);
        anything but "rl" is an eval episode and always kept."""
        item = ("episode", traj, phase, split, global_step, rl_step)
        if phase != "rl":
            self._put_waiting(item, f"eval episode {traj.task_id}/{traj.sample_index}")
        elif not self._sampled(traj):
            self._count("sampled_out")
        else:
            self._put_or_drop(item)

    @_timed
    def put_training(self, rl_step: int, trajectories: Sequence[Trajectory], batch: Batch,
                     tensors: RLStepTensors) -> None:
        """The trainer's side of `batch` (built from `trajectories` by `Batch.collate`: one row
        per exact sequence, in order): its loss mask (the one trained on, after overlong
        masking and key steps) and `tensors`, each episode's rows put back end to end so they
        line up with its tokens. Updates the rows of the episodes that were written."""
        seeds = [t.seed for t in trajectories]
        segments = [t.segments() for t in trajectories]
        self._put_or_drop(("training", rl_step, seeds, segments, batch.loss_mask,
                           batch.episode_index, tensors))

    @_timed
    def put_ledger(self, rl_step: int, global_step: int, ledger: dict[str, float]) -> None:
        self._put_or_drop(("ledger", rl_step, global_step, dict(ledger)))

    @_timed
    def put_at_end(self, rl_step: int, trajectories: Sequence[Trajectory]) -> None:
        """Mark the RL episodes the end of RL (in step `rl_step`) left untrained: `at_end` = 1
        on the rows of those written, whenever they were."""
        # after the last step: nothing to keep from waiting, and the marks are few
        self._put_waiting(("at_end", rl_step, [t.seed for t in trajectories]),
                          f"at_end marks of rl step {rl_step}")

    def stats(self) -> dict[str, float]:
        """Cumulative counts (episodes written, sampled out, dropped at the cap or at a full
        queue, eval episodes past the cap, trained rows updated, steps, rows marked at_end),
        the payload MiB, the writer thread's CPU seconds and the callers' seconds inside put_*."""
        with self._lock:
            out = {f"traces/{k}": float(v) for k, v in self._counts.items()}
            out["traces/payload_mb"] = self._bytes / 2**20
        out["traces/writer_cpu_s"] = self._cpu_s
        out["traces/put_s"] = self._put_s
        out["traces/queued"] = float(self._queue.qsize())
        return out

    def close(self) -> dict[str, float]:
        """Write everything queued, then close; returns the final `stats`. Raises RunError when
        the writer failed or did not drain within close_timeout_s (naming what was left)."""
        if not self._closed:
            self._closed = True
            deadline = time.monotonic() + self.close_timeout_s
            try:
                if self._thread.is_alive():  # a writer that failed reads no end marker
                    self._queue.put(None, timeout=self.close_timeout_s)
            except queue.Full:
                pass  # the join below times out too and says what is left
            self._thread.join(timeout=max(deadline - time.monotonic(), 0.0))
            if self._thread.is_alive():
                raise RunError(f"traces: the writer did not finish {self.path} within "
                               f"{self.close_timeout_s:g}s (observe.traces.close_timeout_s): "
                               f"{self._queue.qsize()} items (episodes, training updates, "
                               f"ledger rows) were still queued")
        self._check()
        return self.stats()

    def _sampled(self, traj: Trajectory) -> bool:
        if self.sample_rate >= 1.0:
            return True
        h = derive_seed("traces", self.seed, traj.task_id, traj.sample_index, traj.seed)
        return h < self.sample_rate * 2**63

    def _check(self) -> None:
        if self._error is not None:
            raise RunError(f"traces: writing {self.path} failed: {type(self._error).__name__}: "
                           f"{self._error}") from self._error

    def _check_open(self) -> None:
        if self._closed:
            raise RunError(f"traces: {self.path} is closed; nothing more can be written")
        self._check()

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _put_or_drop(self, item: tuple) -> None:
        self._check_open()
        try:
            self._queue.put_nowait(item)
        except queue.Full:  # training does not wait for the traces
            self._count("dropped_queue")
            if item[0] != "episode":
                log.warning("traces: the writer queue is full; the %s row of rl step %d was "
                            "dropped (observe.traces.queue_size)", item[0], item[1])

    def _put_waiting(self, item: tuple, what: str) -> None:
        self._check_open()
        try:
            self._queue.put(item, timeout=self.close_timeout_s)
        except queue.Full as e:
            raise RunError(f"traces: no room in the writer queue for the {what} within "
                           f"{self.close_timeout_s:g}s (observe.traces.close_timeout_s): the "
                           f"writer is stuck") from e

    # ------------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        try:
            con = self._connect()
        except BaseException as e:
            self._error = e
            return
        try:
            done = False
            while not done:
                items = [self._queue.get()]
                while len(items) < 256:  # one transaction per batch of whatever is queued
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                done = items[-1] is None
                self._write_batch(con, [item for item in items if item is not None])
                self._cpu_s = time.thread_time()
        except BaseException as e:  # raised on the next put, and by close
            self._error = e
            log.error("traces: writing %s failed (%s: %s); the run stops at its next put",
                      self.path, type(e).__name__, e)
        finally:
            con.close()

    def _write_batch(self, con: sqlite3.Connection, items: list[tuple]) -> None:
        """One transaction; an item that fails is rolled back alone (its savepoint), the
        items before it are committed, and the error is raised."""
        con.execute("BEGIN")
        try:
            for item in items:
                con.execute("SAVEPOINT item")
                try:
                    getattr(self, f"_write_{item[0]}")(con, *item[1:])
                except BaseException:
                    con.execute("ROLLBACK TO item")
                    raise
                con.execute("RELEASE item")
        finally:
            con.execute("COMMIT")

    def _write_episode(self, con: sqlite3.Connection, traj: Trajectory, phase: str, split: str,
                       global_step: int, rl_step: int | None) -> None:
        row = _episode_row(traj, phase, split, global_step, rl_step)
        calls = [(t, i, r.call.name, _json(r.call.arguments), r.content, r.outcome.value,
                  r.latency_s) for i, (t, r) in enumerate(traj.tool_results)]
        size = _payload_bytes(row) + sum(_payload_bytes(c) for c in calls)
        over = self.max_bytes is not None and self._bytes + size > self.max_bytes
        if over and phase == "rl":
            self._count("dropped_cap")
            return
        if over:
            if not self._counts["eval_over_cap"]:
                log.warning("traces: eval episodes take %s past observe.traces.max_mb; they are "
                            "written anyway (counted as traces/eval_over_cap)", self.path)
            self._count("eval_over_cap")
        episode_id = con.execute(_INSERT_EPISODE, row).lastrowid
        con.executemany("INSERT INTO tool_calls (episode_id, turn, idx, name, arguments, "
                        "result, outcome, latency_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [(episode_id, *c) for c in calls])
        if phase == "rl" and traj.seed is not None:  # a seedless one cannot be found again
            self._rl_rows[traj.seed] = episode_id
        with self._lock:
            self._counts["written"] += 1
            self._bytes += size

    def _write_training(self, con: sqlite3.Connection, rl_step: int, seeds: list[int | None],
                        segments: list[list[tuple[int, int]]], loss_mask: torch.Tensor,
                        episode_index: torch.Tensor, tensors: RLStepTensors) -> None:
        columns = (("train_mask", loss_mask.cpu().numpy()),
                   ("trainer_logprobs", tensors.logp_old.cpu().numpy()),
                   ("advantages", tensors.advantages.cpu().numpy()))
        owner = episode_index.tolist()  # the trajectory of each row
        if sum(map(len, segments)) != len(owner):
            raise ValueError(f"rl step {rl_step}: {len(owner)} batch rows for "
                             f"{sum(map(len, segments))} sequences")
        first = 0  # the row of the episode's first sequence: collate keeps them in order
        for i, (seed, spans) in enumerate(zip(seeds, segments, strict=True)):
            rows = range(first, first + len(spans))
            first += len(spans)
            if any(owner[r] != i for r in rows):
                raise ValueError(f"rl step {rl_step}: the batch's rows are not the episodes' "
                                 f"sequences in order (episode_index {owner})")
            arrays = tuple(_pack(np.concatenate([a[r, :end - start] for r, (start, end)
                                                 in zip(rows, spans, strict=True)]), c)
                           for c, a in columns)
            episode_id = self._rl_rows.get(seed)
            if episode_id is None:  # the episode was sampled out or dropped (counted then)
                continue
            con.execute("UPDATE episodes SET trained_step = ?, train_mask = ?, "
                        "trainer_logprobs = ?, advantages = ? WHERE id = ?",
                        (rl_step, *arrays, episode_id))
            with self._lock:
                self._counts["trained"] += 1
                self._bytes += sum(map(len, arrays))

    def _write_at_end(self, con: sqlite3.Connection, rl_step: int, seeds: list[int | None]
                      ) -> None:
        ids = [self._rl_rows[s] for s in seeds if s in self._rl_rows]
        con.executemany("UPDATE episodes SET at_end = 1 WHERE id = ?", [(i,) for i in ids])
        self._count("at_end", len(ids))  # fewer than seeds: sampled out or dropped

    def _write_ledger(self, con: sqlite3.Connection, rl_step: int, global_step: int,
                      ledger: dict[str, float]) -> None:
        con.execute("INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?)",
                    (rl_step, global_step, time.time(), json.dumps(ledger)))
        self._count("steps")


# ---------------------------------------------------------------------- the reader's side


def schema_version(con: sqlite3.Connection) -> int | None:
    """The schema version a traces database was written with (None: no meta row yet)."""
    if con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
                   ).fetchone() is None:
        return None
    row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else json.loads(row[0])


def connect(db: str | Path) -> sqlite3.Connection:
    """A read-only connection to a traces.sqlite (a missing file is an error, not a new empty
    database; so is another schema version: its columns differ); rows come back as
    `sqlite3.Row`."""
    path = Path(db)
    if not path.is_file():
        raise FileNotFoundError(f"no traces database at {path}")
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    found = schema_version(con)
    if found != SCHEMA_VERSION:
        con.close()
        raise RunFolderError(f"{path} holds traces of schema version {found}; this tiller "
                             f"reads version {SCHEMA_VERSION} (docs/traces.md): read it with "
                             f"the tiller that wrote it, or with plain sqlite3")
    con.row_factory = sqlite3.Row
    return con


def decode(column: str, value: bytes | None) -> list | None:
    """One per-token blob column as a list (None stays None: not trained)."""
    return None if value is None else np.frombuffer(value, dtype=ARRAYS[column]).tolist()


def _as_connection(db: str | Path | sqlite3.Connection) -> tuple[sqlite3.Connection, bool]:
    return (db, False) if isinstance(db, sqlite3.Connection) else (connect(db), True)


def read_episode(db: str | Path | sqlite3.Connection, episode_id: int) -> dict[str, Any] | None:
    """Episode `episode_id` with its arrays decoded to lists, its JSON columns parsed and its
    tool calls (`tool_calls_list`, in call order); None when there is no such episode."""
    con, own = _as_connection(db)
    try:
        con.row_factory = sqlite3.Row
        row = con.execute("SELECT * FROM episodes WHERE id = ?", (episode_id,)).fetchone()
        if row is None:
            return None
        out = dict(row)
        for c in ARRAYS:
            out[c] = decode(c, out[c])
        for c in JSON_COLUMNS:
            out[c] = json.loads(out[c])
        calls = con.execute("SELECT turn, idx, name, arguments, result, outcome, latency_s "
                            "FROM tool_calls WHERE episode_id = ? ORDER BY idx", (episode_id,))
        out["tool_calls_list"] = [{**dict(c), "arguments": json.loads(c["arguments"])}
                                  for c in calls]
        return out
    finally:
        if own:
            con.close()


def query(db: str | Path | sqlite3.Connection, *, phase: str | None = None,
          split: str | None = None, status: str | None = None, rl_step: int | None = None,
          task_id: str | None = None, trained: bool | None = None,
          min_reward: float | None = None, max_reward: float | None = None,
          order_by: str = "id", descending: bool = False, limit: int = 50, offset: int = 0
          ) -> list[dict[str, Any]]:
    """One page of episode summaries (`SUMMARY_COLUMNS`: no arrays, no messages) matching
    every filter given, ordered by `order_by` (one of `_ORDER_BY`), then id."""
    if order_by not in _ORDER_BY:
        raise ValueError(f"order_by: got {order_by!r}; expected one of {', '.join(_ORDER_BY)}")
    if limit < 1 or offset < 0:
        raise ValueError(f"limit must be >= 1 and offset >= 0, got limit={limit}, "
                         f"offset={offset}")
    where, args = [], []
    for condition, value in (("phase = ?", phase), ("split = ?", split),
                             ("status = ?", status), ("rl_step = ?", rl_step),
                             ("task_id = ?", task_id), ("reward >= ?", min_reward),
                             ("reward <= ?", max_reward)):
        if value is not None:
            where.append(condition)
            args.append(value)
    if trained is not None:
        where.append(f"trained_step IS {'NOT ' if trained else ''}NULL")
    direction = "DESC" if descending else "ASC"
    sql = (f"SELECT {', '.join(SUMMARY_COLUMNS)} FROM episodes "
           f"{'WHERE ' + ' AND '.join(where) if where else ''} "
           f"ORDER BY {order_by} {direction}, id {direction} LIMIT ? OFFSET ?")
    con, own = _as_connection(db)
    try:
        con.row_factory = sqlite3.Row
        rows = con.execute(sql, (*args, limit, offset)).fetchall()
        return [{**dict(r), **{c: json.loads(r[c]) for c in JSON_COLUMNS
                               if c in SUMMARY_COLUMNS}} for r in rows]
    finally:
        if own:
            con.close()
