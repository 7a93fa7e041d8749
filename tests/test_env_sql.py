"""The SQL env: seeded databases and changes split by hash, a read-only query tool, a full-state
verifier, an expert at >= 95%, a random policy near 0, tool errors the model sees, and a short
training run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from helpers import RL_MOVES, TINY_ENV_RUN, TextActor, check_short_run

from tiller.config import load_config
from tiller.controller import train
from tiller.envs import ENVS
from tiller.envs.actions import ParsedTurn
from tiller.envs.sql import SqlEnv, build_db, make_tasks, snapshot
from tiller.models import train_tokenizer
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.rollout.collect import collect_expert
from tiller.rollout.trajectory import is_success
from tiller.tools.registry import ToolCall

CONFIG = Path(__file__).parents[1] / "configs" / "sql.yaml"
LIMITS = EpisodeLimits(max_turns=5, max_episode_tokens=1 << 16)
TOK = train_tokenizer([], 0)


SQL_WORDS = ["SELECT", "UPDATE", "DELETE", "FROM", "WHERE", "SET", "employees", "orders",
             "products", "*", "=", "1", "dept"]


def RandomSql(turns=None, tok=TOK):
    def make_args(rng, junk):
        return {"sql": " ".join(rng.choice(SQL_WORDS) for _ in range(rng.randint(1, 8)))}

    return TextActor(tok, turns, tools=("query", "execute"), make_args=make_args,
                     finals=("{junk}", "Done."))


def _episode(task, actor, seed=0):
    return asyncio.run(run_episode(SqlEnv(), task, actor, TOK, seed=seed, limits=LIMITS))


def test_splits_are_disjoint_and_every_change_does_something():
    train_tasks = make_tasks("train", 300, seed=1, difficulty=3)
    heldout_tasks = make_tasks("heldout", 100, seed=1, difficulty=3)
    assert not {t.id for t in train_tasks} & {t.id for t in heldout_tasks}
    assert [t.id for t in make_tasks("train", 5, 1, 3)] == [t.id for t in train_tasks[:5]]
    assert {len(t.answer) for t in train_tasks} == {1, 2, 3}
    for t in train_tasks[:50]:
        before, after = build_db(t.metadata["db_seed"]), build_db(t.metadata["db_seed"])
        for sql in t.answer:
            assert after.execute(sql).rowcount > 0
        assert snapshot(before) != snapshot(after)


def test_expert_scores_at_least_95_percent():
    tasks = make_tasks("heldout", 50, seed=0, difficulty=3)
    trajs = collect_expert(ENVS["sql"], tasks, TOK, guess=0.0, limits=LIMITS, seed=0)
    assert sum(map(is_success, trajs)) / len(trajs) >= 0.95
    assert all(t.tool_errors == 0 and t.num_turns == 3 for t in trajs)


def test_random_policy_scores_near_zero():
    tasks = make_tasks("heldout", 50, seed=0, difficulty=2)

    async def run():
        return await asyncio.gather(*(run_episode(SqlEnv(), t, RandomSql(), TOK, seed=i,
                                                  limits=LIMITS) for i, t in enumerate(tasks)))
    trajs = asyncio.run(run())
    assert sum(map(is_success, trajs)) / len(trajs) <= 0.05
    assert sum(t.tool_errors for t in trajs) > 0


def test_bad_tool_calls_reach_the_model_as_errors():
    task = make_tasks("train", 1, seed=0, difficulty=1)[0]
    calls = [{"name": "query", "arguments": {"sql": ["SELECT 1"]}},
             {"name": "drop_all", "arguments": {}},
             {"name": "query", "arguments": {"sql": task.answer[0]}},  # a write via query
             {"name": "execute", "arguments": {"sql": "SELEC oops"}},
             {"name": "execute", "arguments": {"sql": "DROP TABLE orders"}}]
    turn = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    traj = _episode(task, RandomSql([turn + "\n<tool_call>\n{]\n</tool_call>", "Done."]))
    errors = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert len(errors) == 6 and all(e.startswith("error:") for e in errors)
    assert any("invalid arguments" in e for e in errors)
    assert any("unknown tool" in e for e in errors)
    assert sum("not authorized" in e for e in errors) == 2  # the write via query, the DROP
    assert traj.tool_errors == 5 and traj.parse_errors == 1 and traj.env_errors == 0
    assert traj.reward.value == 0.0  # nothing changed


def _run_then_verify(task, statements, final="Done."):
    async def run():
        env = SqlEnv()
        await env.reset(task, 0)
        outs = [await env.registry.invoke(ToolCall("execute", {"sql": s})) for s in statements]
        reward = await env.verify(ParsedTurn(final) if final is not None else None)
        await env.close()
        return outs, reward
    return asyncio.run(run())


def test_verifier_checks_the_full_state():
    raise_task = next(t for t in make_tasks("train", 200, seed=2, difficulty=1)
                      if "raise" in t.prompt)
    assert _run_then_verify(raise_task, raise_task.answer)[1].value == 1.0
    # the same change in other SQL (float arithmetic) is the same state
    dept, pct = raise_task.answer[0].split("'")[1], int(raise_task.answer[0].split("* ")[1][:3])
    other = f"UPDATE employees SET salary = salary * {pct / 100} WHERE dept = '{dept}'"
    assert _run_then_verify(raise_task, [other])[1].value == 1.0
    # too much, too little, or not finished
    assert _run_then_verify(raise_task, [*raise_task.answer, "DELETE FROM orders WHERE id = 1"]
                            )[1].value == 0.0
    assert _run_then_verify(raise_task, [])[1].checks["state_matches"] == 0.0
    assert _run_then_verify(raise_task, raise_task.answer, final=None)[1].value == 0.0


def test_query_is_read_only_and_rows_come_back_as_text():
    task = make_tasks("train", 1, seed=0)[0]

    async def run():
        env = SqlEnv()
        await env.reset(task, 0)
        rows = await env.registry.invoke(ToolCall("query", {"sql": "SELECT name, dept FROM "
                                                                   "employees ORDER BY id"}))
        blocked = await env.registry.invoke(ToolCall("query", {"sql": "DELETE FROM orders"}))
        attach = await env.registry.invoke(ToolCall("execute", {"sql": "ATTACH 'x.db' AS x"}))
        return rows, blocked, attach, snapshot(env.db), snapshot(build_db(task.metadata["db_seed"]))

    rows, blocked, attach, state, initial = asyncio.run(run())
    assert rows.outcome.value == "ok" and rows.content.splitlines()[0] == "name | dept"
    assert len(rows.content.splitlines()) == 9
    assert blocked.outcome.value == "tool_error" and attach.outcome.value == "tool_error"
    assert state == initial


def test_short_training_run(tmp_path):
    cfg = load_config(CONFIG, [*TINY_ENV_RUN, *RL_MOVES, "model.build.corpus_tasks=50",
                               f"output_dir={tmp_path}"])
    summary = train(cfg)
    assert summary["sft"]["expert_success"] >= 0.5
    check_short_run(cfg, summary, lambda tok: RandomSql(tok=tok))
