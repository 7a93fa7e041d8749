"""Letters: count a letter in a string with the `count_letter` tool (docs/quickstart.md).

A small environment written against tiller's extension API, outside tiller: tasks with a
train/held-out split by hash, one typed tool, a scripted expert for SFT and a strict verifier.
`env.name=letters:LettersEnv` names it, with this folder on PYTHONPATH.
"""

from __future__ import annotations

import json
import random
from typing import Any

from tiller.envs import Task, ToolEnv
from tiller.envs.actions import ParsedTurn
from tiller.envs.splits import draw_split, split_size, stable_id
from tiller.envs.verifiers import Reward, all_of, extract_answer_is
from tiller.tools.registry import ToolError, tool

ALPHABET = "abcdef"
SYSTEM = "Count with the count_letter tool. End with: The answer is N."


@tool
def count_letter(text: str, letter: str) -> int:
    """Count how many times a letter occurs in a text.

    Args:
        text: the text to search.
        letter: the single letter to count.

    Returns:
        The number of occurrences of the letter in the text.
    """
    if len(letter) != 1:
        # the policy's mistake: the model sees "error: ..." as the tool's answer
        raise ToolError(f"letter must be one character, got {letter!r}")
    return text.count(letter)


def word_length(difficulty: int) -> int:
    """Longer strings at higher difficulty: 4 letters at 1, 6 at 2, ..."""
    return 2 + 2 * difficulty


class LettersEnv(ToolEnv):
    name = "letters"

    def __init__(self, **kwargs: Any):
        super().__init__([count_letter], **kwargs)

    @staticmethod
    def make_tasks(split: str, n: int, seed: int, difficulty: int = 1) -> list[Task]:
        """`n` distinct (text, letter) tasks of `split`; the split is a hash of the pair, so
        train and held-out never share one, whatever the seed."""
        rng = random.Random(f"letters/{split}/{seed}/{difficulty}")

        def draw(r: random.Random) -> tuple[str, str]:
            text = "".join(r.choice(ALPHABET) for _ in range(word_length(difficulty)))
            return text, r.choice(ALPHABET)

        pairs = draw_split(split, n, rng, draw, key=lambda p: f"{p[0]}/{p[1]}")
        return [Task(id=stable_id("letters", f"{text}/{letter}"),
                     prompt=f"How many times does {letter!r} occur in {text!r}?",
                     answer=text.count(letter), split=split, system=SYSTEM,
                     metadata={"text": text, "letter": letter, "difficulty": difficulty})
                for text, letter in pairs]

    @staticmethod
    def task_space(split: str, difficulty: int, heldout_fraction: float = 0.2) -> int:
        """Every string of the length times every letter, by its expected share of `split`."""
        total = len(ALPHABET) ** word_length(difficulty) * len(ALPHABET)
        return split_size(total, split, heldout_fraction)

    @staticmethod
    def expert_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                    guess_prob: float = 0.0) -> str:
        """One `count_letter` call, then its result as the answer. With `guess_prob` (drawn at
        the first turn) it answers the string's length without the tool: confidently wrong
        unless every letter is the one asked for."""
        results = [m for m in messages if m["role"] == "tool"]
        if results:
            return f"The answer is {results[-1]['content']}."
        if rng.random() < guess_prob:
            return f"The answer is {len(task.metadata['text'])}."
        call = {"name": "count_letter",
                "arguments": {"text": task.metadata["text"], "letter": task.metadata["letter"]}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    async def verify(self, final: ParsedTurn | None) -> Reward:
        """1 only for a final turn (no tool call) ending "The answer is N." with the right N."""
        assert self.task is not None
        text = None if final is None or final.tool_calls or final.parse_errors else final.content
        answer = extract_answer_is(text)
        return all_of(format_ok=answer is not None,
                      correct=answer is not None and answer == str(self.task.answer))
