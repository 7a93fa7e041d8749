"""SQL: make a requested change to a real SQLite database; the final state decides.

Each task is a small database (employees, orders, products) generated from its own seed, and
1..`difficulty` (at most 3) changes drawn from the data ("Give every employee in Sales a 10%
raise.", "Delete all orders placed before 2024-03-01."), each chosen to touch at least one row.
The episode gets a fresh in-memory copy at reset; `query` is read-only (an SQLite authorizer
allows only reads), `execute` may insert, update and delete rows and nothing else (no schema
changes, pragmas, ATTACH or VACUUM INTO, which writes files). The reward is a full-state
check: every table's columns and sorted rows must equal those of a second copy to which the
reference SQL was applied. Split by a hash of (database seed, changes).
"""

from __future__ import annotations

import json
import random
import sqlite3
import time
from typing import Any

from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Task, ToolEnv, register_env
from tiller.envs.splits import draw_split, split_size, stable_id
from tiller.envs.verifiers import Reward, all_of, state_matches
from tiller.tools.registry import ToolError, tool

SYSTEM = ("Change the database as asked: inspect it with query, change it with execute "
          "(one SQL statement per call). Answer Done. when finished.")
SCHEMA = """\
CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, dept TEXT NOT NULL,
                        salary INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, amount INTEGER NOT NULL,
                     placed TEXT NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, stock INTEGER NOT NULL,
                       price INTEGER NOT NULL);
"""
_PEOPLE = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea",
           "Mo", "Nia", "Oto", "Pia"]
_DEPTS = ["Sales", "Support", "Finance", "Marketing"]
_PRODUCTS = ["bolt", "nut", "gear", "lamp", "hose", "pump", "valve", "fan"]
_READS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
          sqlite3.SQLITE_RECURSIVE}  # fmt: skip
_WRITES = _READS | {sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE}


def build_db(db_seed: int) -> sqlite3.Connection:
    """The task's starting database, in memory (autocommit, so every change is visible)."""
    rng = random.Random(db_seed)
    db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    db.executescript(SCHEMA)
    for name in rng.sample(_PEOPLE, 8):
        db.execute("INSERT INTO employees (name, dept, salary) VALUES (?, ?, ?)",
                   (name, rng.choice(_DEPTS), 100 * rng.randint(300, 1200)))
    for _ in range(10):
        day = f"202{rng.randint(3, 4)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        db.execute("INSERT INTO orders (customer, amount, placed) VALUES (?, ?, ?)",
                   (rng.choice(_PEOPLE[:5]), rng.randint(10, 500), day))
    for name in rng.sample(_PRODUCTS, 6):
        db.execute("INSERT INTO products (name, stock, price) VALUES (?, ?, ?)",
                   (name, rng.randint(0, 50), rng.randint(5, 200)))
    return db


def _column(db: sqlite3.Connection, sql: str) -> list[Any]:
    return sorted({row[0] for row in db.execute(sql)})


def _draw_change(rng: random.Random, db: sqlite3.Connection) -> tuple[str, str, str]:
    """(instruction, reference SQL, inspection query), with parameters taken from the data."""
    kind = rng.choice(["raise", "move", "fire", "old_orders", "customer", "restock", "price"])
    if kind in ("raise", "move", "fire"):
        depts, salaries = _column(db, "SELECT dept FROM employees"), _column(
            db, "SELECT salary FROM employees")
        look = "SELECT * FROM employees"
        if kind == "raise" and depts:
            d, p = rng.choice(depts), rng.choice([5, 10, 15, 20])
            return (f"Give every employee in {d} a {p}% raise.",
                    f"UPDATE employees SET salary = salary * {100 + p} / 100 WHERE dept = '{d}'",
                    f"{look} WHERE dept = '{d}'")
        if kind == "move" and depts:
            a = rng.choice(depts)
            b = rng.choice([d for d in _DEPTS if d != a])
            return (f"Move every employee in {a} to {b}.",
                    f"UPDATE employees SET dept = '{b}' WHERE dept = '{a}'",
                    f"{look} WHERE dept = '{a}'")
        x = rng.choice(salaries[1:] or [0])
        return (f"Remove every employee earning less than {x}.",
                f"DELETE FROM employees WHERE salary < {x}", f"{look} ORDER BY salary")
    if kind == "old_orders":
        day = rng.choice(_column(db, "SELECT placed FROM orders")[1:] or ["2000-01-01"])
        return (f"Delete all orders placed before {day}.",
                f"DELETE FROM orders WHERE placed < '{day}'",
                "SELECT * FROM orders ORDER BY placed")
    if kind == "customer":
        c = rng.choice(_column(db, "SELECT customer FROM orders") or ["nobody"])
        return (f"Delete every order of {c}.", f"DELETE FROM orders WHERE customer = '{c}'",
                f"SELECT * FROM orders WHERE customer = '{c}'")
    look = "SELECT * FROM products"
    if kind == "restock":
        n = rng.choice(_column(db, "SELECT stock FROM products")) + 1
        m = n + rng.randint(5, 20)
        return (f"Set the stock of every product with fewer than {n} units to {m}.",
                f"UPDATE products SET stock = {m} WHERE stock < {n}", f"{look} WHERE stock < {n}")
    x, y = rng.choice(_column(db, "SELECT price FROM products")[:-1] or [0]), rng.randint(1, 5)
    return (f"Lower the price of every product that costs more than {x} by {y}.",
            f"UPDATE products SET price = price - {y} WHERE price > {x}",
            f"{look} WHERE price > {x}")


def _draw(rng: random.Random, difficulty: int,
          max_tries: int = 1000) -> tuple[int, tuple[tuple[str, str, str], ...]]:
    db_seed, changes, k = rng.randrange(2**31), [], rng.randint(1, min(difficulty, 3))
    db = build_db(db_seed)
    for _ in range(max_tries):
        change = _draw_change(rng, db)
        if change not in changes and db.execute(change[1]).rowcount > 0:  # must touch a row
            changes.append(change)
        if len(changes) == k:
            db.close()
            return db_seed, tuple(changes)
    raise RuntimeError(f"sql: database {db_seed} gave only {len(changes)} of {k} distinct "
                       f"changes that touch a row in {max_tries} draws")


def snapshot(db: sqlite3.Connection) -> dict[str, list[Any]]:
    """Every table: its column names, then its rows sorted (floats that are whole become ints
    and the rest are rounded, so `salary * 1.1` and `salary * 110 / 100` agree)."""
    def norm(v: Any) -> Any:
        if not isinstance(v, float):
            return v
        v = round(v, 6)
        return int(v) if v.is_integer() else v

    state = {}
    for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        cur = db.execute(f'SELECT * FROM "{table}"')
        rows = sorted((tuple(map(norm, row)) for row in cur), key=repr)
        state[table] = [tuple(c[0] for c in cur.description), *rows]
    return state


def make_tasks(split: str, n: int, seed: int, difficulty: int = 2,
               heldout_fraction: float = 0.2) -> list[Task]:
    rng = random.Random(f"sql/{split}/{seed}/{difficulty}")
    drawn = draw_split(split, n, rng, lambda r: _draw(r, difficulty), json.dumps,
                       heldout_fraction)
    tables = ("employees(id, name, dept, salary), orders(id, customer, amount, placed: "
              "'YYYY-MM-DD'), products(id, name, stock, price)")
    return [Task(id=stable_id("sql", json.dumps([s, c])), split=split, system=SYSTEM,
                 prompt=f"Tables: {tables}.\nTask: " + " Then ".join(
                     x[0] if i == 0 else x[0][0].lower() + x[0][1:] for i, x in enumerate(c)),
                 answer=[x[1] for x in c], metadata={"db_seed": s, "changes": c,
                                                   "difficulty": len(c)})
            for s, c in drawn]  # fmt: skip


def task_space(split: str, difficulty: int, heldout_fraction: float = 0.2) -> int:
    """At least the expected share of the 2^31 database seeds (each task has its own)."""
    return split_size(2**31, split, heldout_fraction)


def expert_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                guess_prob: float = 0.0) -> str:
    """Inspect the rows the first change touches, execute the reference SQL, say Done.
    With `guess_prob` it says Done. without changing anything."""
    done = sum(m["role"] == "tool" for m in messages)
    changes = task.metadata["changes"]
    if done == 0 and rng.random() < guess_prob:
        return "Done."
    if done == 0:
        calls = [("query", changes[0][2])]
    elif done == 1:
        calls = [("execute", c[1]) for c in changes]
    else:
        return "Done."
    return "\n".join("<tool_call>\n" + json.dumps({"name": t, "arguments": {"sql": sql}})
                     + "\n</tool_call>" for t, sql in calls)


def _run(db: sqlite3.Connection, sql: str, allowed: Any, max_seconds: float = 2.0) -> str:
    """One statement under an authorizer and a time limit; errors go back to the model."""
    deadline = time.monotonic() + max_seconds
    db.set_authorizer(allowed)
    db.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)
    try:
        cur = db.execute(sql)
        rows = cur.fetchmany(31)
    except (sqlite3.Error, sqlite3.Warning) as e:  # Warning: more than one statement
        raise ToolError(f"{type(e).__name__}: {e}") from e
    finally:
        db.set_authorizer(None)
        db.set_progress_handler(None, 0)
    if cur.description is None:
        return f"ok, {max(cur.rowcount, 0)} rows changed"
    lines = [" | ".join(c[0] for c in cur.description)]
    lines += [" | ".join(map(str, r)) for r in rows[:30]]
    return "\n".join(lines + (["... (more rows)"] if len(rows) > 30 else []))


@register_env
class SqlEnv(ToolEnv):
    name = "sql"

    make_tasks = staticmethod(make_tasks)
    task_space = staticmethod(task_space)
    expert_turn = staticmethod(expert_turn)

    def __init__(self, **kwargs: Any):
        self.db: sqlite3.Connection | None = None

        @tool
        async def query(sql: str) -> str:
            """Run a read-only SQL query and return the rows.

            Args:
                sql: one SELECT statement.
            """
            ok, deny = sqlite3.SQLITE_OK, sqlite3.SQLITE_DENY
            return _run(self._db(), sql, lambda action, *_: ok if action in _READS else deny)

        @tool
        async def execute(sql: str) -> str:
            """Run one SQL statement that changes the database.

            Args:
                sql: one INSERT, UPDATE or DELETE statement.
            """
            ok, deny = sqlite3.SQLITE_OK, sqlite3.SQLITE_DENY
            return _run(self._db(), sql, lambda action, *_: ok if action in _WRITES else deny)

        super().__init__([query, execute], **kwargs)

    def _db(self) -> sqlite3.Connection:
        assert self.db is not None, "reset() first"
        return self.db

    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        self.db = build_db(task.metadata["db_seed"])
        return await super().reset(task, seed)

    async def verify(self, final: ParsedTurn | None) -> Reward:
        assert self.task is not None
        target = build_db(self.task.metadata["db_seed"])
        for sql in self.task.answer:
            target.execute(sql)
        matches = state_matches(snapshot(self._db()), snapshot(target))
        target.close()
        return all_of(answered=final is not None, state_matches=matches)

    async def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None
