import asyncio
import random

from tiller.envs import ENVS
from tiller.envs.calculator import Problem, calculate
from tiller.rollout.chat import parse_tool_calls
from tiller.tools.registry import ToolCall, ToolOutcome, ToolRegistry

Calc = ENVS["calculator"]


def test_tasks_are_reproducible_and_splits_disjoint():
    a = Calc.make_tasks("train", 300, seed=7, difficulty=3)
    b = Calc.make_tasks("train", 300, seed=7, difficulty=3)
    assert [t.prompt for t in a] == [t.prompt for t in b]
    train = {t.metadata["problem"].key() for t in Calc.make_tasks("train", 3000, 1, 2)}
    held = {t.metadata["problem"].key() for t in Calc.make_tasks("heldout", 500, 1, 2)}
    assert len(held) == 500 and not train & held


def test_difficulty_bounds_the_number_of_operations():
    for d in (1, 3):
        steps = [len(t.metadata["problem"].steps) + 1 for t in Calc.make_tasks("train", 200, 0, d)]
        assert max(steps) == d and min(steps) == 1


def test_answer_is_the_chained_arithmetic():
    p = Problem(12, 34, (("-", 8), ("*", 3)))
    assert p.results() == [408, 400, 1200]


def test_tool_computes_one_operation_and_rejects_more():
    reg = ToolRegistry([calculate])
    ok = asyncio.run(reg.invoke(ToolCall("calculate", {"expression": " 37 * 24 "})))
    two = asyncio.run(reg.invoke(ToolCall("calculate", {"expression": "1 + 2 + 3"})))
    assert (ok.outcome, ok.content) == (ToolOutcome.OK, "888")
    assert two.outcome is ToolOutcome.TOOL_ERROR and "one operation" in two.content


def test_verifier_gates_on_format_and_correctness():
    env = Calc()
    task = Calc.make_tasks("train", 1, 0, 1)[0]
    asyncio.run(env.reset(task, 0))

    def score(text):
        return asyncio.run(env.verify(parse_tool_calls(text)))

    right = score(f"The answer is {task.answer}.")
    wrong = score(f"The answer is {task.answer + 1}.")
    buried = score(f"The answer is {task.answer} or maybe 3.")
    assert right.value == 1.0 and right.checks == {"format_ok": 1.0, "correct": 1.0}
    assert wrong.value == 0.0 and wrong.checks == {"format_ok": 1.0, "correct": 0.0}
    assert buried.value == 0.0 and buried.checks["format_ok"] == 0.0
    assert asyncio.run(env.verify(None)).value == 0.0


def test_expert_uses_one_call_per_operation_and_guesses_when_told():
    task = next(t for t in Calc.make_tasks("train", 50, 0, 3) if t.metadata["problem"].steps)
    first = Calc.expert_turn(task, [], random.Random(0), guess_prob=0.0)
    p = task.metadata["problem"]
    assert parse_tool_calls(first).tool_calls == [
        ToolCall("calculate", {"expression": f"{p.a} * {p.b}"})]
    guess = Calc.expert_turn(task, [], random.Random(0), guess_prob=1.0)
    assert guess == f"The answer is {p.a}{p.b}."  # confidently wrong: 100a + b > a * b
