"""The Trajectory: one finished episode, exactly as the policy saw and produced it.

Token ids are the source of truth: `token_ids` is the prompt, then each generated turn as the
engine returned it, then each observation as tokenized by the loop, concatenated. `loss_mask`
is 1 exactly on generated tokens and `logprobs` holds the engine's log-probability there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tiller.envs.verifiers import Reward


class Status(str, Enum):
    COMPLETED = "completed"  # the policy gave a final answer
    TRUNCATED = "truncated"  # turn limit, token budget or context hit first
    ABORTED = "aborted"  # the engine or the loop failed
    ENV_ERROR = "env_error"  # a tool or the environment failed: not the policy's fault


@dataclass(frozen=True)
class Trajectory:
    task_id: str
    sample_index: int
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_len: int
    turn_spans: tuple[tuple[int, int], ...]  # [start, end) of each generated turn
    versions: tuple[int, ...]  # weight version that generated each turn
    messages: tuple[dict[str, Any], ...]
    reward: Reward
    status: Status
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0
    parse_errors: int = 0
    timings: Mapping[str, float] = field(default_factory=dict)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)
