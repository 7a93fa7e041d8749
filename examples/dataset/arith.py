"""The example's reward functions and tool: a package outside tiller, named by dotted path in
config.yaml (`arith:correct`), with TRL's reward_funcs signature."""

from __future__ import annotations

import re


def _text(completion: str | list[dict]) -> str:
    """The final answer: the completion itself (standard) or its last message (conversational)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the final answer's last number is the row's answer."""
    out = []
    for completion, target in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", _text(completion))
        out.append(float(bool(numbers) and int(numbers[-1]) == int(target)))
    return out


def brief(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 for a final answer of at most 12 characters, less for longer ones."""
    return [min(1.0, 12 / max(len(_text(c)), 1)) for c in completions]


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
