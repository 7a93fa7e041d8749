"""PairSum: add two digits with the `add` tool. A deliberately small task set: the 100 pairs
(a, b) of digits, drawn with replacement, so a task list repeats instances (each draw is its
own group in tiller), and all of it is for training: there is no held-out split, so a run
skips held-out evaluation and says so in summary.json.

Nothing here is imported by tiller: `env.name=tiller_example_plugin.envs:PairSumEnv` names it.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from typing import Any

from tiller.envs import Task, ToolEnv
from tiller.envs.actions import ParsedTurn
from tiller.envs.dataset import DatasetEnv
from tiller.envs.verifiers import Reward, all_of
from tiller_example_plugin.tools import add

SYSTEM = "Add the two numbers with the add tool. End with: The answer is N."
PAIRS = [(a, b) for a in range(10) for b in range(10)]
_ANSWER = re.compile(r"answer is\s+(-?\d+)\s*\.?\s*$", re.IGNORECASE)


class PairSumEnv(ToolEnv):
    name = "pair_sum"
    splits = ("train",)  # every pair is a training task: no held-out evaluation
    repeats_tasks = True  # `make_tasks` draws with replacement: n may exceed the 100 pairs

    def __init__(self, **kwargs: Any):
        super().__init__([add], **kwargs)

    @staticmethod
    def make_tasks(split: str, n: int, seed: int, difficulty: int) -> list[Task]:
        if split not in PairSumEnv.splits:
            raise ValueError(f"pair_sum has no {split!r} split (only {PairSumEnv.splits})")
        rng = random.Random(f"pair_sum/{seed}")
        return [Task(id=f"pair-{a}-{b}", prompt=f"What is {a} + {b}?", answer=a + b,
                     split=split, system=SYSTEM, metadata={"pair": (a, b)})
                for a, b in (rng.choice(PAIRS) for _ in range(n))]

    @staticmethod
    def task_space(split: str, difficulty: int, heldout_fraction: float = 0.2) -> int:
        return len(PAIRS) if split in PairSumEnv.splits else 0

    @staticmethod
    def expert_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                    guess_prob: float = 0.0) -> str:
        """One `add` call, then the answer; with `guess_prob`, a guess without the tool (the
        digits written together: wrong unless a is 0)."""
        a, b = task.metadata["pair"]
        results = [m for m in messages if m["role"] == "tool"]
        if results:
            return f"The answer is {results[-1]['content']}."
        if rng.random() < guess_prob:
            return f"The answer is {a}{b}."
        call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        return f"<tool_call>\n{call}\n</tool_call>"

    async def verify(self, final: ParsedTurn | None) -> Reward:
        assert self.task is not None
        m = None if final is None or final.tool_calls else _ANSWER.search(final.content)
        answer = int(m.group(1)) if m else None
        return all_of(format_ok=answer is not None, correct=answer == self.task.answer)


class BriefRowsEnv(DatasetEnv):
    """The dataset env (rows of data.train, rewards from the config) with one more necessary
    condition of this package's own: an answer longer than 40 characters earns nothing.
    `env.name=tiller_example_plugin.envs:BriefRowsEnv` with `data:` and `rewards:`."""

    async def verify(self, final: ParsedTurn | None) -> Reward:
        reward = await super().verify(final)
        brief = final is not None and len(final.content) <= 40
        return replace(reward, value=reward.value if brief else 0.0,
                       checks={**reward.checks, "brief_gate": float(brief)})
