"""An agent loop for tests/test_openenv.py: odd samples are played by a scripted bisection
player on examples/openenv/guess_env.py (through the `step` tool), even samples by the policy,
both through tiller's own loop (`agent.loop: openenv_loop:run_episode`, tests/ importable).
The scripted tokens are stamped with the engine's version so RL trains on them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from helpers import scripted_generation

from tiller.rollout.agent_loop import run_episode as tiller_episode


@dataclass
class Bisector:
    """Guesses the middle of the range the hints so far leave (1..16 at first)."""

    tokenizer: Any
    policy: Any  # the run's actor: its engine's version stamps the scripted tokens
    low: int = 1
    high: int = 16
    guess: int | None = None

    def turn(self, messages: list[dict[str, Any]]) -> str:
        hint = messages[-1]["content"] if messages[-1]["role"] == "tool" else ""
        if self.guess is not None and "higher" in hint:
            self.low = self.guess + 1
        elif self.guess is not None and "lower" in hint:
            self.high = self.guess - 1
        self.guess = (self.low + self.high) // 2
        call = {"name": "step", "arguments": {"guess": self.guess}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    async def act(self, prompt_ids, messages, seed, session_id=None):
        return scripted_generation(self.tokenizer, self.policy, self.turn(messages))


async def run_episode(env, task, actor, tokenizer, *, seed, limits, sample_index=0):
    if sample_index % 2:
        actor = Bisector(tokenizer, actor)
    return await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                sample_index=sample_index)
