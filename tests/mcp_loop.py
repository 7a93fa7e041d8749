"""An agent loop for tests/test_mcp.py: odd samples are played by a scripted agent that calls
the example MCP server's tools and answers with what they returned, even samples by the
policy, both through tiller's own loop (name it `agent.loop: mcp_loop:run_episode` with tests/
importable). The scripted tokens are stamped with the engine's weight version, as if sampled,
so RL trains on them and the reward varies within each group."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from helpers import scripted_generation

from tiller.rollout.agent_loop import run_episode as tiller_episode


def scripted_turn(messages: list[dict[str, Any]]) -> str:
    """Call the tool the question needs; once it answered, answer with its result."""
    tools = [m for m in messages if m["role"] == "tool"]
    if tools:
        return tools[-1]["content"].removeprefix("error: ")
    question = [m["content"] for m in messages if m["role"] == "user"][-1]
    country = re.search(r"capital of (\w+)", question)
    call = ({"name": "lookup", "arguments": {"country": country.group(1)}} if country else
            {"name": "calculate",
             "arguments": {"expression": re.search(r"What is (.+)\?", question).group(1)}})
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


@dataclass
class ScriptedAgent:
    tokenizer: Any
    policy: Any  # the run's actor: its engine's version stamps the scripted tokens

    async def act(self, prompt_ids, messages, seed, session_id=None):
        return scripted_generation(self.tokenizer, self.policy, scripted_turn(messages))


async def run_episode(env, task, actor, tokenizer, *, seed, limits, sample_index=0):
    if sample_index % 2:
        actor = ScriptedAgent(tokenizer, actor)
    return await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                sample_index=sample_index)
