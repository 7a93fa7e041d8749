"""Calculator: arithmetic word problems solved through a one-operation `calculate` tool.

A task chains 1..`difficulty` operations on two- and three-digit numbers ("37 bags of 24
marbles, then gives away 85"), far beyond what a small model computes in its head. The tool
evaluates one operation `a op b` per call, so a task with k operations needs k calls, each
feeding its result into the next. Instances are split into train and held-out by a hash of
their arithmetic, so the two splits never share one.
"""

from __future__ import annotations

import json
import operator
import random
import re
from dataclasses import dataclass
from typing import Any

from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Task, ToolEnv, register_env
from tiller.envs.splits import Patience, check_split, split_of, split_size, stable_id
from tiller.envs.verifiers import Reward, all_of
from tiller.tools.registry import ToolError, tool

SYSTEM = (
    "Solve the problem with the calculate tool, one operation per call. "
    "End with: The answer is N."
)
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_BINARY = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")
_ANSWER = re.compile(r"answer is\s+(-?\d+)\s*\.?\s*$", re.IGNORECASE)
# The numbers a problem draws from: two factors, then per step an addend/subtrahend or a
# multiplier. `task_space` counts problems from the same ranges.
_FACTORS, _TERMS, _MULTIPLIERS = range(11, 100), range(10, 1000), range(2, 10)
_NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun"]
_ITEMS = ["marbles", "stamps", "coins", "shells", "cards", "beads", "pens", "apples"]
_CONTAINERS = ["bags", "boxes", "jars", "crates", "tins", "trays"]
_TEMPLATES = {
    "opening": "{name} has {a} {box} with {b} {item} in each.",
    "+": "Then {name} finds {x} more.",
    "-": "Then {name} gives away {x}.",
    "*": "Then {name} makes the pile {x} times as large.",
    "question": "How many {item} does {name} have now?",
}
# Wordings no train or heldout task uses: the `ood_templates` split asks held-out problems in
# them, so it measures whether the policy learned the numbers' roles or the templates' words.
_OOD_TEMPLATES = {
    "opening": "There are {a} {box}, and each of them holds {b} {item} owned by {name}.",
    "+": "Later {name} is handed {x} extra.",
    "-": "After that {name} loses {x} of them.",
    "*": "Next the whole collection grows to {x} times its size.",
    "question": "What is the final number of {item} that {name} owns?",
}
OOD_TEMPLATES = "ood_templates"


@tool
def calculate(expression: str) -> str:
    """Evaluate one operation on two integers.

    Args:
        expression: 'a op b' with op in + - *, e.g. '37 * 24'.
    """
    m = _BINARY.match(expression)
    if m is None:
        raise ToolError(f"expected one operation 'a op b' with op in + - *, got {expression!r}")
    a, op, b = m.groups()
    return str(_OPS[op](int(a), int(b)))


@dataclass(frozen=True)
class Problem:
    """The arithmetic of a task: start with a*b, then apply (op, x) for each step."""

    a: int
    b: int
    steps: tuple[tuple[str, int], ...]

    def key(self) -> str:
        return f"{self.a}*{self.b}" + "".join(f"{op}{x}" for op, x in self.steps)

    def results(self) -> list[int]:
        values = [self.a * self.b]
        for op, x in self.steps:
            values.append(_OPS[op](values[-1], x))
        return values


def _draw(rng: random.Random, difficulty: int) -> Problem:
    n_ops = rng.randint(1, difficulty)
    steps = []
    for _ in range(n_ops - 1):
        op = rng.choice("+-*")
        steps.append((op, rng.choice(_MULTIPLIERS if op == "*" else _TERMS)))
    return Problem(rng.choice(_FACTORS), rng.choice(_FACTORS), tuple(steps))


def _text(problem: Problem, rng: random.Random, templates: dict[str, str]) -> str:
    name, item, box = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    words = dict(name=name, item=item, box=box, a=problem.a, b=problem.b)
    parts = [templates["opening"].format(**words)]
    parts += [templates[op].format(**words, x=x) for op, x in problem.steps]
    parts.append(templates["question"].format(**words))
    return " ".join(parts)


def make_tasks(
    split: str, n: int, seed: int, difficulty: int = 2, heldout_fraction: float = 0.2
) -> list[Task]:
    """`n` distinct tasks of `split` ("train", "heldout", or "ood_templates": held-out
    problems worded in templates no other split uses), reproducible from `seed`."""
    ood = split == OOD_TEMPLATES
    problems = "heldout" if ood else split  # the hash split the problems come from
    check_split(problems)
    rng = random.Random(f"calculator/{split}/{seed}/{difficulty}")
    tasks: dict[str, Task] = {}
    patience = Patience(split, n)  # difficulty 1 has only 89² problems
    while len(tasks) < n:
        problem = _draw(rng, difficulty)
        new = (split_of(problem.key(), heldout_fraction) == problems
               and problem.key() not in tasks)
        patience.record(new)
        if not new:
            continue
        tasks[problem.key()] = Task(
            id=stable_id("calc-ood" if ood else "calc", problem.key()),
            prompt=_text(problem, rng, _OOD_TEMPLATES if ood else _TEMPLATES),
            answer=problem.results()[-1],
            split=split,
            system=SYSTEM,
            # difficulty: the operations, i.e. the tool calls the task needs
            metadata={"problem": problem, "difficulty": len(problem.steps) + 1},
        )
    return list(tasks.values())


def task_space(split: str, difficulty: int, heldout_fraction: float = 0.2) -> int:
    """Distinct problems of `split`: the 89² one-operation ones are counted (split by hash),
    beyond difficulty 1 there are 89²·Σ_{k<d} 1988^k (millions), so their expected share.
    ood_templates words heldout problems differently, so it has heldout's count."""
    split = "heldout" if split == OOD_TEMPLATES else split
    if difficulty == 1:
        keys = (Problem(a, b, ()).key() for a in _FACTORS for b in _FACTORS)
        return split_size(keys, split, heldout_fraction)
    per_step = 2 * len(_TERMS) + len(_MULTIPLIERS)  # + and - take a term, * a multiplier
    total = len(_FACTORS) ** 2 * sum(per_step**k for k in range(difficulty))
    return split_size(total, split, heldout_fraction)


def expert_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                guess_prob: float = 0.0) -> str:
    """The scripted expert: one `calculate` call per operation, then the answer.

    With probability `guess_prob` (drawn once, at the first turn) it skips the tool and
    answers by writing the problem's first two numbers together, a confident wrong answer
    (100a + b > a*b for two-digit a, b). That is how SFT data gets its share of imperfect
    demonstrations; they still teach the same skill as the good ones (copying numbers from
    the problem), so only the decision to call the tool is left for RL to fix.
    """
    problem: Problem = task.metadata["problem"]
    done = [m for m in messages if m["role"] == "tool"]
    if not done and rng.random() < guess_prob:
        return f"The answer is {problem.a}{problem.b}."
    if not done:
        expr = f"{problem.a} * {problem.b}"
    elif len(done) <= len(problem.steps):
        op, x = problem.steps[len(done) - 1]
        expr = f"{done[-1]['content']} {op} {x}"
    else:
        return f"The answer is {done[-1]['content']}."
    call = json.dumps({"name": "calculate", "arguments": {"expression": expr}})
    return f"<tool_call>\n{call}\n</tool_call>"


def final_answer(final: ParsedTurn | None) -> int | None:
    if final is None or final.tool_calls or final.parse_errors:
        return None
    m = _ANSWER.search(final.content)
    return int(m.group(1)) if m else None


@register_env
class CalculatorEnv(ToolEnv):
    name = "calculator"
    eval_splits = ("heldout", OOD_TEMPLATES)

    make_tasks = staticmethod(make_tasks)
    task_space = staticmethod(task_space)
    expert_turn = staticmethod(expert_turn)

    def __init__(self, **kwargs: Any):
        super().__init__([calculate], **kwargs)

    async def verify(self, final: ParsedTurn | None) -> Reward:
        answer = final_answer(final)
        assert self.task is not None
        return all_of(format_ok=answer is not None, correct=answer == self.task.answer)
