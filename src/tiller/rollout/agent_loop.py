"""The agent loop: one multi-turn episode from task to `Trajectory`, token in, token out.

The prompt is rendered with the tokenizer's chat template once. After that the loop only
appends: each generated turn as the engine's ids (never decoded and re-encoded; decoding is
used to parse tool calls, nothing else), then each observation as the text the chat template
adds for the new messages, tokenized on its own. Users replace this function with their own
`async def` of the same signature, named by a dotted path in the config (`agent.loop`).
"""

from __future__ import annotations

import hashlib
import importlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from tiller.envs.base import Env, Task
from tiller.envs.verifiers import Reward
from tiller.rollout.chat import ParsedTurn, parse_tool_calls, tool_calls_as_messages
from tiller.rollout.engine import EmbeddedEngine, Generation, SamplingParams
from tiller.rollout.trajectory import Status, Trajectory
from tiller.tools.registry import ToolOutcome


class Actor(Protocol):
    """Whatever writes the assistant turns: the engine, or a scripted expert."""

    async def act(self, prompt_ids: list[int], messages: list[dict], seed: int) -> Generation: ...


@dataclass
class EngineActor:
    engine: EmbeddedEngine
    params: SamplingParams

    async def act(self, prompt_ids: list[int], messages: list[dict], seed: int) -> Generation:
        return await self.engine.generate(prompt_ids, self.params, seed)


@dataclass
class ExpertActor:
    """Turns the env's scripted expert into token ids (its text is not model output, so
    tokenizing it is right); `guess_prob` is its share of imperfect demonstrations."""

    env_cls: type[Env]
    task: Task
    tokenizer: PreTrainedTokenizerBase
    guess_prob: float = 0.0

    async def act(self, prompt_ids: list[int], messages: list[dict], seed: int) -> Generation:
        rng = random.Random(seed)
        text = self.env_cls.expert_turn(self.task, messages, rng, self.guess_prob)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        return Generation(ids, [0.0] * len(ids), "stop", version=-1)


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    max_episode_tokens: int = 1024


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1


def _assistant_message(turn: ParsedTurn) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        msg["tool_calls"] = tool_calls_as_messages(turn.tool_calls)
    return msg


async def run_episode(
    env: Env,
    task: Task,
    actor: Actor,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    sample_index: int = 0,
    limits: EpisodeLimits = EpisodeLimits(),
) -> Trajectory:
    """Run one episode and verify it. Never raises for what the policy or a tool did."""
    t0 = time.perf_counter()
    timings = {"generate_s": 0.0, "env_s": 0.0}
    tools = env.tool_schemas()
    messages = await env.reset(task, seed)

    def render(msgs: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    ids = tokenizer.encode(render(messages, True), add_special_tokens=False)
    prompt_len = len(ids)
    mask, logprobs = [0] * prompt_len, [0.0] * prompt_len
    spans: list[tuple[int, int]] = []
    versions: list[int] = []
    counts = {"tool_calls": 0, "tool_errors": 0, "env_errors": 0, "parse_errors": 0}
    final: ParsedTurn | None = None
    status = Status.TRUNCATED

    for turn in range(limits.max_turns):
        t = time.perf_counter()
        try:
            gen = await actor.act(ids, messages, derive_seed(seed, turn))
        except Exception as e:
            status = Status.ABORTED
            messages.append({"role": "error", "content": f"{type(e).__name__}: {e}"})
            break
        timings["generate_s"] += time.perf_counter() - t
        gen_ids = gen.token_ids[: max(0, limits.max_episode_tokens - len(ids))]
        spans.append((len(ids), len(ids) + len(gen_ids)))
        versions.append(gen.version)
        ids += gen_ids
        mask += [1] * len(gen_ids)
        logprobs += gen.logprobs[: len(gen_ids)]
        parsed = parse_tool_calls(tokenizer.decode(gen_ids, skip_special_tokens=False))
        messages.append(_assistant_message(parsed))
        if gen.finish_reason != "stop" or len(gen_ids) < len(gen.token_ids):
            break  # the turn was cut off: truncated

        t = time.perf_counter()
        try:
            result = await env.step(parsed)
        except Exception as e:  # the environment itself broke
            counts["env_errors"] += 1
            messages.append({"role": "error", "content": f"{type(e).__name__}: {e}"})
            break
        finally:
            timings["env_s"] += time.perf_counter() - t
        counts["parse_errors"] += len(parsed.parse_errors)
        counts["tool_calls"] += len(result.tool_results)
        outcomes = [r.outcome for r in result.tool_results]
        counts["tool_errors"] += outcomes.count(ToolOutcome.TOOL_ERROR)
        counts["env_errors"] += outcomes.count(ToolOutcome.ENV_ERROR)
        if result.done:
            final, status = parsed, Status.COMPLETED
            break

        # The observation is exactly what the template adds after the generated eos token.
        before = render(messages, False)
        before = before[: before.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]
        messages.extend(result.messages)
        after = render(messages, True)
        if not after.startswith(before):
            raise ValueError("the chat template is not prefix-stable across turns")
        obs_ids = tokenizer.encode(after[len(before):], add_special_tokens=False)
        if len(ids) + len(obs_ids) >= limits.max_episode_tokens:
            break
        ids += obs_ids
        mask += [0] * len(obs_ids)
        logprobs += [0.0] * len(obs_ids)

    try:
        reward = await env.verify(final)
    except Exception as e:  # a broken checker (sandbox down, ...) is the environment's failure
        counts["env_errors"] += 1
        messages.append({"role": "error", "content": f"verifier: {type(e).__name__}: {e}"})
        reward = Reward(0.0, {"verifier_error": 1.0})
    if reward.env_error:  # the verifier found the env broken (sandbox down, scorer crashed)
        counts["env_errors"] += 1
    if counts["env_errors"]:
        status = Status.ENV_ERROR
        reward = replace(reward, env_error=True)
    await env.close()
    timings["total_s"] = time.perf_counter() - t0
    return Trajectory(
        task_id=task.id,
        sample_index=sample_index,
        token_ids=tuple(ids),
        loss_mask=tuple(mask),
        logprobs=tuple(logprobs),
        prompt_len=prompt_len,
        turn_spans=tuple(spans),
        versions=tuple(versions),
        messages=tuple(messages),
        reward=reward,
        status=status,
        timings=timings,
        **counts,
    )


EpisodeFn = Callable[..., Awaitable[Trajectory]]


def load_episode_fn(path: str) -> EpisodeFn:
    """Resolve `package.module:function` (or `package.module.function`) to the loop."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"agent.loop {path!r} cannot be imported: {e}") from e
    if not callable(fn):
        raise ValueError(f"agent.loop {path!r} is not callable")
    return fn
