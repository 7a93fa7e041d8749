"""SFT demonstrations from a file of conversations (`data.sft`) instead of a scripted expert.

Each conversation becomes a `Trajectory` exactly as the agent loop would have built it had the
policy written its assistant turns: the opening messages rendered once as the prompt, each
assistant turn as its own tokens plus the end-of-turn token (loss mask 1), and the messages
between turns as the observation ids the loop appends (`ChatFormat.observation_ids`, mask 0).
So SFT trains on the same tokens, with the same masks, as expert demonstrations and RL.
An assistant turn's text is what the chat template renders for the message (its content, and
its `tool_calls` in the template's own syntax).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tiller.envs.dataset import Conversation, resolve_tools
from tiller.envs.rows import row_error
from tiller.envs.verifiers import Reward
from tiller.rollout.chat import ChatFormat
from tiller.rollout.trajectory import Status, Trajectory, TrajectoryBuilder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tiller.config import DataConfig

def assistant_text(chat: ChatFormat, before: list[dict[str, Any]],
                   message: dict[str, Any]) -> str:
    """What the template renders for assistant `message` after `before`, between the
    generation prompt and the end-of-turn token: the text the policy would have generated."""
    prompt = chat.render(before, True)
    full = chat.render([*before, message], False)
    if not full.startswith(prompt):
        raise ValueError("the chat template is not prefix-stable: rendering an assistant "
                         "turn changes the text before it")
    rest = full[len(prompt):]
    end = rest.find(chat.end_of_turn)
    if end < 0:
        raise ValueError(f"the chat template rendered no {chat.end_of_turn!r} after an "
                         "assistant turn")
    return rest[:end]


def conversation_trajectory(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                            tokenizer: PreTrainedTokenizerBase, task_id: str,
                            family: str = "auto") -> Trajectory:
    """One conversation as the trajectory the agent loop would build (module docstring), in
    chat format `family` (`model.chat_format`)."""
    chat = ChatFormat(tokenizer, tools, family)
    traj = TrajectoryBuilder(task_id)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    traj.append_prompt(chat.prompt_ids(messages[: assistant[0]]))
    for k, i in enumerate(assistant):
        text = assistant_text(chat, messages[:i], messages[i])
        ids = [*tokenizer.encode(text, add_special_tokens=False), chat.end_of_turn_id]
        traj.append_generated(ids, [0.0] * len(ids), version=-1)
        if k + 1 < len(assistant):  # the messages up to the next assistant turn
            traj.append_observation(chat.observation_ids(messages[: i + 1],
                                                         messages[i + 1 : assistant[k + 1]]))
    return traj.finish(Reward(0.0), Status.COMPLETED, messages=messages)


def conversation_demos(conversations: list[Conversation], tokenizer: PreTrainedTokenizerBase,
                       data: DataConfig, max_tokens: int, env_schemas: Sequence[dict] = (),
                       family: str = "auto") -> list[Trajectory]:
    """The demonstrations of `data.sft`, their prompts rendered with the env's own tool
    schemas (`env_schemas`, as every RL prompt is) and the row's tools; a conversation longer
    than `max_tokens` (the episode budget, env.max_episode_tokens) is an error naming its row,
    never cut or dropped."""
    demos = []
    path, col = str(data.sft), data.sft_messages_column
    for n, messages, paths in conversations:
        # [] without tools, as the agent loop passes an env's (empty) schemas
        schemas = [*env_schemas, *(t.schema for t in resolve_tools(paths, "data.sft"))]
        try:
            traj = conversation_trajectory(messages, schemas, tokenizer, f"sft:{n}", family)
        except ValueError as e:  # the template cannot render it as the loop would
            raise row_error(path, n, col, str(e)) from e
        if len(traj.token_ids) > max_tokens:
            raise row_error(path, n, col, f"{len(traj.token_ids)} tokens, more than "
                            f"env.max_episode_tokens={max_tokens}; raise it or shorten the row")
        demos.append(traj)
    return demos
