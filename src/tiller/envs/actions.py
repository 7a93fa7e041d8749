"""What the model's turn is to an environment: a `ParsedTurn` (free text, well-formed tool calls,
parse errors, reasoning), and the message shape a chat template renders for it. Envs step on
these; `rollout.chat` parses generated ids into them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiller.tools.registry import ToolCall


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into free text, well-formed tool calls and parse errors."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    reasoning: str = ""  # the turn's <think> text, for families that reason


def tool_calls_as_messages(calls: list[ToolCall]) -> list[dict]:
    """Tool calls in the OpenAI/HF message shape the chat template renders."""
    return [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def assistant_message(turn: ParsedTurn) -> dict[str, Any]:
    """A parsed assistant turn as the message the chat template renders."""
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.reasoning:  # the field Qwen3's and DeepSeek's templates read, and gpt-oss's
        msg["reasoning_content"] = msg["thinking"] = turn.reasoning
    if turn.tool_calls:
        msg["tool_calls"] = tool_calls_as_messages(turn.tool_calls)
    return msg
