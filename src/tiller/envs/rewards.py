"""Rewards of a dataset env: library verifiers by name and TRL-style reward functions, weighted
and gated (the `rewards:` config section, docs/datasets.md).

A function has TRL's `reward_funcs` signature:

    def reward(prompts, completions, **columns) -> list[float | None]

called once per episode with lists of length 1 (tiller scores each episode as it ends, so the
engine keeps batching the others). `prompts` / `completions` follow TRL's two formats:
standard (the prompt is a string, the completion the final answer's text) or conversational
(the prompt is a list of messages, the completion the list of messages the episode added after
it: assistant turns and tool results). Every other column of the row comes as a keyword of the
same name (TRL's "all columns but prompt and completion"). TRL's `completion_ids`,
`trainer_state`, `log_extra` and `log_metric` keywords are not passed: the env never sees token
ids, there is no HF TrainerState here, and every entry's value is logged per check anyway
(`check/<name>`). A function written for TRL takes `**kwargs`, so it runs unchanged.

The total: 0 when an entry marked `gate` does not pass (value < 1, the rule of
`verifiers.all_of`), else the sum of weight * value over the entries. A function's None means
"does not apply to this row" (as in TRL): the entry adds nothing, gates nothing and is left out
of the checks.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tiller.envs.verifiers import (
    JUDGE,
    Reward,
    exact_match,
    extract_answer_is,
    extract_tagged,
    normalized_match,
    numeric_match,
    parse_number,
    regex_match,
)
from tiller.errors import ConfigError, import_dotted
from tiller.tools.threads import run_in_thread

logger = logging.getLogger(__name__)

# Library verifiers by name: (extracted answer, the row's answer) -> passed?
VERIFIERS: dict[str, Callable[[str | None, Any], bool]] = {
    "exact_match": lambda got, target: exact_match(got, str(target)),
    "normalized_match": lambda got, target: normalized_match(
        got, target if isinstance(target, list) else str(target)),
    "numeric_match": lambda got, target: numeric_match(got, float(target)),
    "regex_match": lambda got, target: regex_match(got, str(target)),
}

EXTRACTORS: dict[str, Callable[[str | None], str | None]] = {
    "tagged": extract_tagged,  # the one final <answer>...</answer>
    "answer_is": extract_answer_is,  # a last line "The answer is X."
    "text": lambda text: None if text is None else text.strip(),  # the whole final answer
}


def answer_problem(verifier: str, answer: Any) -> str | None:
    """Why `answer` (a row's answer column) cannot be a target of `verifier`, or None."""
    if verifier == "numeric_match":
        number = answer if isinstance(answer, (int, float)) and not isinstance(answer, bool) \
            else parse_number(answer) if isinstance(answer, str) else None
        return None if number is not None else f"expected a number for numeric_match, got " \
                                               f"{answer!r}"
    if verifier == "normalized_match" and isinstance(answer, list):
        return None if all(isinstance(a, str) for a in answer) else \
            "expected a string or a list of strings for normalized_match"
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        return f"expected a string or number for {verifier}, got {type(answer).__name__}"
    return None


@dataclass(frozen=True)
class RewardEntry:
    """One resolved entry of `rewards:`: a library verifier or an imported function."""

    name: str
    weight: float
    gate: bool
    verifier: str | None = None
    extract: str = "tagged"
    fn: Callable[..., Any] | None = None
    path: str | None = None  # the function's dotted path, for error messages


def resolve_entries(entries: Sequence[Any]) -> list[RewardEntry]:
    """`RewardConfig`s -> `RewardEntry`s; each function imported now (a bad dotted path is one
    line at start-up). An entry named `judge` (by `name` or its function's name) is refused:
    the name is rl.judge's, whose score a run records and pays under it."""
    out = []
    for i, e in enumerate(entries):
        if e.function is not None:
            fn = import_dotted(e.function, f"rewards[{i}].function")
            name = e.name or getattr(fn, "__name__", f"reward_{i}")
            out.append(RewardEntry(name, e.weight, e.gate, fn=fn, path=e.function))
        else:
            out.append(RewardEntry(e.name or e.verifier, e.weight, e.gate, verifier=e.verifier,
                                   extract=e.extract or "tagged"))
    names = [e.name for e in out]
    if JUDGE in names:
        i = names.index(JUDGE)
        raise ConfigError(f"config field rewards[{i}]: named {JUDGE!r}, a name reserved for "
                          "rl.judge's score; give the entry another `name`")
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"config field rewards: two entries are named {dup!r}; give each a "
                          "distinct `name` (it is the check's name in the logs)")
    return out


def combine(entries: Sequence[RewardEntry], values: Sequence[float | None]) -> Reward:
    """The total of the entries' values (None: not applicable), with each value as a check."""
    checks = {e.name: v for e, v in zip(entries, values, strict=True) if v is not None}
    gated = any(e.gate and v is not None and v < 1.0
                for e, v in zip(entries, values, strict=True))
    total = 0.0 if gated else sum(e.weight * v for e, v in zip(entries, values, strict=True)
                                  if v is not None)
    return Reward(float(total), checks)


async def call_function(entry: RewardEntry, prompt: Any, completion: Any,
                        columns: dict[str, Any]) -> float | None:
    """`entry.fn` on one episode with TRL's keywords, in a thread of its own (a slow reward
    function must not stall the event loop that drives every other episode). A result that is
    not a list of one number (or None) is the user's bug in every episode: a ConfigError,
    which stops the run. An exception inside the function propagates to the caller."""
    kwargs = {k: [v] for k, v in columns.items()}
    if inspect.iscoroutinefunction(entry.fn):
        out = await entry.fn(prompts=[prompt], completions=[completion], **kwargs)
    else:
        out = await run_in_thread(entry.fn, prompts=[prompt], completions=[completion], **kwargs)
    if not isinstance(out, (list, tuple)) or len(out) != 1:
        raise ConfigError(f"reward function {entry.path}: expected a list with one value per "
                          f"completion (1 here), got {type(out).__name__} {str(out)[:60]}")
    value = out[0]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"reward function {entry.path}: expected a finite number or None per "
                          f"completion, got {value!r}")
    return float(value)
