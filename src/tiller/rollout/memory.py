"""What a long episode keeps in its context (`agent.memory`), and what each choice means for
token-in, token-out.

- `full`: everything, as sampled; the episode is truncated when the episode token budget is hit.
- `truncate_tool_output`: each tool message is cut to `agent.tool_output_tokens` tokens before
  the model sees it. The cut text is what the observation appends and what later turns render,
  so the stream stays one exact sequence.
- `drop_oldest`: when the next context would leave less than one turn's room in the budget, the
  oldest exchanges (an assistant turn and the tool results after it) are dropped and the kept
  messages are rendered as a new prompt: the episode goes on in a new exact sequence
  (`TrajectoryBuilder.start_segment(ids, "memory_dropped")`), and what was sampled before is
  trained in its own row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

Memory = Literal["full", "drop_oldest", "truncate_tool_output"]
TRUNCATED_MARK = "\n[... {n} more tokens cut]"


@dataclass(frozen=True)
class MemoryPolicy:
    mode: Memory = "full"
    tool_output_tokens: int = 0  # truncate_tool_output: tokens kept of each tool message
    reserve_tokens: int = 0  # drop_oldest: room one generated turn needs after the context


def truncate_tool_outputs(messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase,
                          max_tokens: int) -> tuple[list[dict[str, Any]], int]:
    """`messages` with every tool message's content cut to its first `max_tokens` tokens (and a
    mark saying how many were cut), and how many were cut. Tool output is environment text,
    not model output, so encoding and decoding it changes nothing that was sampled."""
    out, cut = [], 0
    for m in messages:
        if m.get("role") == "tool" and isinstance(m.get("content"), str):
            ids = tokenizer.encode(m["content"], add_special_tokens=False)
            if len(ids) > max_tokens:
                text = tokenizer.decode(ids[:max_tokens], skip_special_tokens=False)
                m = {**m, "content": text + TRUNCATED_MARK.format(n=len(ids) - max_tokens)}
                cut += 1
        out.append(m)
    return out, cut


def exchanges(messages: list[dict[str, Any]], opening: int) -> list[list[dict[str, Any]]]:
    """The messages after the first `opening` ones, split into exchanges: each starts at an
    assistant message and holds what followed it until the next one."""
    out: list[list[dict[str, Any]]] = []
    for m in messages[opening:]:
        if m.get("role") == "assistant" or not out:
            out.append([])
        out[-1].append(m)
    return out


def drop_oldest(messages: list[dict[str, Any]], opening: int,
                fits: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]] | None:
    """The opening messages and the newest exchanges that `fits` (the rendered prompt is short
    enough): at least the oldest exchange is dropped, the newest is always kept (it holds the
    observation the next turn answers). None when nothing can be dropped or even the opening
    and the newest exchange do not fit."""
    kept = exchanges(messages, opening)[1:]
    while kept:
        context = [*messages[:opening], *(m for ex in kept for m in ex)]
        if fits(context):
            return context
        if len(kept) == 1:
            return None
        kept = kept[1:]
    return None
