"""The quickstart's own env (examples/quickstart/letters.py, docs/quickstart.md): loaded by
dotted path from outside tiller as the doc says, its split, tool and verifier, a tiny run of
its config through `tiller train`'s pipeline, and the doc's code being the file's."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from helpers import RL_MOVES, TINY_RUN, TextActor, check_short_run

from tiller.config import load_config
from tiller.controller import train
from tiller.envs.actions import ParsedTurn
from tiller.plugins import load_env_class
from tiller.tools.registry import ToolCall, ToolOutcome

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart"
DOC = ROOT / "docs" / "quickstart.md"


@pytest.fixture
def letters(monkeypatch):
    monkeypatch.syspath_prepend(str(QUICKSTART))  # what PYTHONPATH=examples/quickstart does
    return load_env_class("letters:LettersEnv")


def test_tasks_split_by_hash_and_answers_are_the_counts(letters):
    train_tasks = letters.make_tasks("train", 300, 0, 1)
    heldout = letters.make_tasks("heldout", 100, 0, 1)
    again = letters.make_tasks("heldout", 100, 7, 1)  # another seed: still never a train task
    assert len({t.id for t in train_tasks}) == 300 and len({t.id for t in heldout}) == 100
    assert not {t.id for t in train_tasks} & ({t.id for t in heldout} | {t.id for t in again})
    assert all(len(t.metadata["text"]) == 4 for t in train_tasks)
    assert all(t.answer == t.metadata["text"].count(t.metadata["letter"]) for t in train_tasks)
    assert {t.answer for t in train_tasks} >= {0, 1, 2}
    # 6^4 strings x 6 letters, the held-out share expected by hash
    assert letters.task_space("heldout", 1) == int(6**4 * 6 * 0.2)


def test_the_tool_counts_and_a_bad_letter_is_the_policys_error(letters):
    async def run():
        env = letters()
        task = letters.make_tasks("train", 1, 0, 1)[0]
        await env.reset(task, 0)
        ok = await env.registry.invoke(ToolCall("count_letter", {"text": "abca", "letter": "a"}))
        bad = await env.registry.invoke(ToolCall("count_letter", {"text": "abca", "letter": "ab"}))
        step = await env.step(ParsedTurn(content="", tool_calls=[
            ToolCall("count_letter", {"text": "abca", "letter": "ab"})]))
        return ok, bad, step

    ok, bad, step = asyncio.run(run())
    assert (ok.outcome, ok.content) == (ToolOutcome.OK, "2")
    assert bad.outcome is ToolOutcome.TOOL_ERROR and "one character" in bad.content
    assert step.messages[0]["content"].startswith("error: letter must be one character")
    assert not step.done


@pytest.mark.parametrize(("final", "value", "checks"), [
    ("The answer is 2.", 1.0, {"format_ok": 1.0, "correct": 1.0}),
    ("The answer is 3.", 0.0, {"format_ok": 1.0, "correct": 0.0}),
    ("It is 2, so the answer is 2. Bye", 0.0, {"format_ok": 0.0, "correct": 0.0}),
    (None, 0.0, {"format_ok": 0.0, "correct": 0.0}),
])
def test_the_verifier_gates_on_the_format_and_the_answer(letters, final, value, checks):
    async def run():
        env = letters()
        task = next(t for t in letters.make_tasks("train", 50, 0, 1) if t.answer == 2)
        await env.reset(task, 0)
        return await env.verify(None if final is None else ParsedTurn(content=final))

    reward = asyncio.run(run())
    assert (reward.value, dict(reward.checks)) == (value, checks)


def random_letters_actor(tok):
    return TextActor(tok, tools=("count_letter",),
                     make_args=lambda rng, junk: {"text": junk, "letter": rng.choice("abcdef")},
                     finals=("The answer is {junk}.", "{junk}"))


def test_a_tiny_run_of_the_quickstart_config(letters, tmp_path):
    cfg = load_config(QUICKSTART / "letters.yaml", [*TINY_RUN, *RL_MOVES,
                                                    "logging.tensorboard=false",
                                                    f"output_dir={tmp_path}"])
    summary = train(cfg)
    assert summary["tool_gate"] == {"gate_ok_rate/count_letter": 1.0}
    assert summary["rl"]["ledger"]["started"] == summary["rl"]["ledger"]["trained"] == 2 * 4 * 4
    assert summary["heldout_after_sft"]["tasks"] == summary["heldout_after_rl"]["tasks"] == 16
    assert (tmp_path / "traces.sqlite").is_file()
    check_short_run(cfg, summary, random_letters_actor)


def test_the_quickstart_shows_the_example_file():
    shown = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    source = (QUICKSTART / "letters.py").read_text()
    assert len(shown) >= 3 and sum(block.count("\n") for block in shown) >= 40
    for block in shown:
        assert block in source, block
