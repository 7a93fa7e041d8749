"""A tool-using agent written against the official `openai` SDK, with nothing tiller-specific
in it: tiller runs it once per episode against its OpenAI-compatible gateway and trains the
model on exactly the tokens it sampled for these calls.

    PYTHONPATH=examples tiller train configs/calculator.yaml \
        agent.program=openai_agent.agent:main

The agent asks the model, runs the `calculate` calls it makes itself (the tool is this file's
own code, not tiller's), sends the results back, and returns the final answer. `compact_main`
is the same agent with a compacting memory: after each tool round it rewrites its history to
the opening messages plus a note of the results so far, which tiller records as a split of the
episode ("history_rewritten") into exact sequences.
"""

from __future__ import annotations

import json
import operator
import re
from typing import Any

import openai

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_BINARY = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


def calculate(expression: str) -> str:
    """One operation `a op b` on two integers, op in + - *."""
    m = _BINARY.match(expression)
    if m is None:
        raise ValueError(f"expected one operation 'a op b' with op in + - *, got {expression!r}")
    a, op, b = m.groups()
    return str(_OPS[op](int(a), int(b)))


def run_tool(name: str, arguments: str) -> str:
    """A tool call's result as the model reads it; a bad call is an error message, so the
    model can correct itself."""
    try:
        args = json.loads(arguments)
        if name != "calculate":
            raise ValueError(f"unknown tool {name!r}")
        return calculate(**args)
    except Exception as e:  # any bad call becomes text for the model
        return f"error: {e}"


async def main(base_url: str, api_key: str, model: str, task: dict[str, Any], *,
               compact: bool = False, max_calls: int = 6) -> str | None:
    """Solve `task` with the model at `base_url`; returns its final answer (None if it never
    gave one within `max_calls` calls)."""
    # max_retries=0: a retried call would sample a new turn the agent never saw (tiller would
    # keep it, as a split); errors here are the gateway saying the episode is over
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        opening = list(task["messages"])
        messages = list(opening)
        notes: list[str] = []
        for _ in range(max_calls):
            response = await client.chat.completions.create(
                model=model, messages=messages, tools=task["tools"])
            message = response.choices[0].message
            if not message.tool_calls:
                return message.content
            messages.append(message)  # sent back exactly as the gateway returned it
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                notes.append(f"calculate({call.function.arguments}) = {result}")
            if compact:  # keep only the opening messages and a note of the results so far
                *head, user = opening
                messages = [*head, {"role": "user", "content": user["content"] + "\n\nResults "
                                    "so far:\n" + "\n".join(notes)}]
    return None


async def compact_main(base_url: str, api_key: str, model: str, task: dict[str, Any]
                       ) -> str | None:
    """`main` with the compacting memory."""
    return await main(base_url, api_key, model, task, compact=True)
