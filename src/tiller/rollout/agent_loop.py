"""The agent loop: one multi-turn episode from task to `Trajectory`, token in, token out.

The prompt is rendered with the tokenizer's chat template once. After that the loop only
appends: each generated turn as the engine's ids (never decoded and re-encoded; decoding is
used to parse tool calls, nothing else), then each observation as the text the chat template
adds for the new messages, tokenized on its own (`ChatFormat`). Users replace this function
with their own `async def` of the same signature, named by a dotted path in the config
(`agent.loop`); a `TrajectoryBuilder` keeps their ids, mask and logprobs aligned.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from tiller.engine.api import Engine, Generation, SamplingParams
from tiller.envs.actions import ParsedTurn, assistant_message
from tiller.envs.base import Env, Task
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError, RunError, import_dotted
from tiller.rollout.chat import FAMILIES, ChatFormat, end_of_turn_token
from tiller.rollout.memory import MemoryPolicy, drop_oldest, truncate_tool_outputs
from tiller.rollout.trajectory import Status, Trajectory, TrajectoryBuilder
from tiller.seeds import derive_seed
from tiller.tools.registry import ToolOutcome

logger = logging.getLogger(__name__)
_logged: set[type[BaseException]] = set()  # exception types whose traceback was logged


class Actor(Protocol):
    """Whatever writes the assistant turns: the engine, or a scripted expert. `session_id`
    names the episode, so an engine can keep its KV between turns."""

    async def act(self, prompt_ids: list[int], messages: list[dict], seed: int,
                  session_id: str | None = None) -> Generation: ...


@dataclass
class EngineActor:
    engine: Engine
    params: SamplingParams

    async def act(self, prompt_ids: list[int], messages: list[dict], seed: int,
                  session_id: str | None = None) -> Generation:
        return await self.engine.generate(prompt_ids, self.params, seed, session_id=session_id)


@dataclass
class ExpertActor:
    """Turns the env's scripted expert into token ids (its text is not model output, so
    tokenizing it is right); `guess_prob` is its share of imperfect demonstrations."""

    env_cls: type[Env]
    task: Task
    tokenizer: PreTrainedTokenizerBase
    guess_prob: float = 0.0

    async def act(self, prompt_ids: list[int], messages: list[dict], seed: int,
                  session_id: str | None = None) -> Generation:
        rng = random.Random(seed)
        text = self.env_cls.expert_turn(self.task, messages, rng, self.guess_prob)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids.append(self.tokenizer.convert_tokens_to_ids(end_of_turn_token(self.tokenizer)))
        return Generation(ids, [0.0] * len(ids), "stop", version=-1)


@dataclass(frozen=True)
class EpisodeLimits:
    """What bounds an episode, and how its turns are rendered."""

    max_turns: int = 8
    max_episode_tokens: int = 1024  # per exact sequence: the context a turn is generated after
    memory: MemoryPolicy = MemoryPolicy()  # what a long episode keeps (`agent.memory`)
    chat_format: str = "auto"  # `model.chat_format`: a family in chat.FAMILIES, or auto
    history: str = "stream"  # `agent.history`: stream (exact sampled ids) or template


def check_rollout_setup(
    tokenizer: PreTrainedTokenizerBase, model_config: PretrainedConfig, limits: EpisodeLimits
) -> None:
    """Start-up checks, so that what would fail in every episode fails once, as one line
    (ConfigError): the chat format and history mode are known, the chat template has an
    end-of-turn token and renders the observation after a tool round trip, and an episode
    fits in the model's context."""
    context = getattr(model_config, "max_position_embeddings", None)
    if context is not None and limits.max_episode_tokens > context:
        raise ConfigError(f"config field env.max_episode_tokens: got {limits.max_episode_tokens}; "
                          f"expected at most the model's context length "
                          f"(max_position_embeddings={context})")
    if limits.history not in HISTORY_MODES:
        raise ConfigError(f"config field agent.history: got {limits.history!r}; expected one "
                          f"of {', '.join(HISTORY_MODES)}")
    chat = ChatFormat(tokenizer, [{"type": "function", "function": {
        "name": "calculate", "description": "Evaluate.", "parameters": {"type": "object"}}}],
        limits.chat_format)
    logger.info("chat format: %s (model.chat_format=%s), history: %s", chat.family,
                limits.chat_format, limits.history)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if limits.chat_format == "auto" and chat.family == "hermes" and "<tool_call>" not in template:
        # a family tiller has no parser for: its tool calls would all read as plain answers
        logger.warning("the chat template holds no marker of a tool-call format tiller parses "
                       "(families: %s); tool calls are parsed as Hermes <tool_call> JSON, which "
                       "this template may not teach: set model.chat_format if it is one of them",
                       ", ".join(FAMILIES))
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"x": "1"}}}
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "What is 1?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        chat.observation_ids(messages, [{"role": "tool", "name": "calculate", "content": "1"}])
    except ValueError as e:
        raise ConfigError(f"{e}; tiller appends observation tokens after each generated turn, "
                          "so use a chat template that closes each assistant turn with its "
                          "end-of-turn token") from e


HISTORY_MODES = ("stream", "template")


# The run's own configuration or state is broken (a sandbox that refuses to start, fail-closed):
# every episode would fail the same way, so these stop the run instead of scoring an episode.
RUN_FAILURES = (ConfigError, RunError)


def error_text(e: BaseException, where: str) -> str:
    """How an episode records a failure in `info`: where, the exception type, its message."""
    return f"{where}: {type(e).__name__}: {e}"


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
    """Run one episode and verify it; `env.close` always runs.

    Never raises for what the policy, a tool, the env, the engine or the chat template did; the
    status says what happened and `info["error"]` why, when something failed:
    COMPLETED (a final answer, or the model ended the conversation with a stop token that is
    not the end-of-turn token: then `info["ended_by"]` names it and the verifier scores no
    final answer), TRUNCATED (turn limit, token budget or `max_new_tokens` first), ABORTED (the
    engine or the loop failed: a chat template that raises or breaks prefix stability, a
    generation with one logprob per id missing; it wins over ENV_ERROR, so that
    `rl.max_aborted_frac` sees it), ENV_ERROR (reset, a step, a tool or the verifier failed,
    or the verifier reported `env_error`). A `ConfigError` or `RunError` raised by the env or
    the actor is the run's problem, not the episode's: it propagates (after `env.close`).
    """
    t0 = time.perf_counter()
    timings = {"generate_s": 0.0, "env_s": 0.0}
    traj = TrajectoryBuilder(task.id, sample_index)
    counts = {"tool_calls": 0, "tool_errors": 0, "env_errors": 0, "parse_errors": 0,
              "tool_outputs_truncated": 0}
    info: dict[str, str] = {}
    messages: list[dict] = []
    final: ParsedTurn | None = None
    status = Status.TRUNCATED
    try:
        try:
            messages = await env.reset(task, seed)
        except RUN_FAILURES:
            raise
        except Exception as e:  # the environment itself broke: nothing to verify
            counts["env_errors"] += 1
            info["error"] = error_text(e, "env.reset")
            reward = Reward(0.0, {"reset_error": 1.0})
        else:
            try:
                chat = ChatFormat(tokenizer, env.tool_schemas(), limits.chat_format)
                traj.append_prompt(chat.prompt_ids(messages))
                final, status = await _turns(env, actor, chat, traj, messages, seed=seed,
                                             session_id=f"{task.id}/{sample_index}/{seed}",
                                             limits=limits, counts=counts, info=info,
                                             timings=timings)
            except RUN_FAILURES:
                raise
            except Exception as e:  # the loop broke (template, tokenizer, a generation's shape)
                info["error"] = error_text(e, "agent loop")
                status = Status.ABORTED
                if type(e) not in _logged:  # a bug's traceback, once per exception type
                    _logged.add(type(e))
                    logger.exception("task %s sample %d: the agent loop broke; the episode is "
                                     "aborted", task.id, sample_index)
            try:
                reward = await env.verify(final)
            except RUN_FAILURES:
                raise
            except Exception as e:  # a broken checker (sandbox down, ...) is the env's failure
                counts["env_errors"] += 1
                info.setdefault("error", error_text(e, "env.verify"))
                reward = Reward(0.0, {"verifier_error": 1.0})
            if reward.env_error:  # the verifier says its own check could not run
                counts["env_errors"] += 1
                why = reward.error or "the verifier reported env_error"
                info.setdefault("error", f"env.verify: {why}")
    finally:
        try:
            await env.close()
        except Exception as e:  # the episode is sound; the leak is logged and recorded
            info["close_error"] = error_text(e, "env.close")
            logger.warning("task %s sample %d: %s", task.id, sample_index, info["close_error"])
    if counts["env_errors"]:
        reward = replace(reward, env_error=True)
        if status is not Status.ABORTED:  # an abort is counted against rl.max_aborted_frac
            status = Status.ENV_ERROR
    timings["total_s"] = time.perf_counter() - t0
    return traj.finish(reward, status, messages=messages, timings=timings, info=info, **counts)


async def _turns(
    env: Env,
    actor: Actor,
    chat: ChatFormat,
    traj: TrajectoryBuilder,
    messages: list[dict],
    *,
    seed: int,
    session_id: str,
    limits: EpisodeLimits,
    counts: dict[str, int],
    info: dict[str, str],
    timings: dict[str, float],
) -> tuple[ParsedTurn | None, Status]:
    """The turns of `run_episode`: generate, parse, step, append the observation; returns the
    final answer (None unless COMPLETED) and the status so far. `messages` records the whole
    conversation; `context` is what the model sees, which differs from it once `drop_oldest`
    memory dropped exchanges (a new exact sequence starts there). With `history="template"`
    each next context is the template's rendering of it; where that is not the sampled stream
    plus the observation (a template that drops earlier reasoning), a new exact sequence
    starts from the rendering."""
    memory, opening, context = limits.memory, len(messages), messages
    for turn in range(limits.max_turns):
        t = time.perf_counter()
        try:
            gen = await actor.act(traj.token_ids, context, derive_seed(seed, turn),
                                  session_id=session_id)
        except RUN_FAILURES:
            raise
        except Exception as e:
            info["error"] = error_text(e, "engine")
            return None, Status.ABORTED
        timings["generate_s"] += time.perf_counter() - t
        keep = max(0, limits.max_episode_tokens - len(traj))
        ids = gen.token_ids[:keep]
        traj.discarded_tokens += len(gen.token_ids) - len(ids)
        # each token keeps the version that sampled it; the turn counts as its oldest
        traj.append_generated(ids, gen.logprobs[:keep], list(gen.versions[:keep]) or gen.version)
        if gen.finish_reason == "abort":  # a partial turn (abort, or an aborting weight update)
            info["error"] = "engine: the request was aborted mid-turn"
            return None, Status.ABORTED
        cut_off = gen.finish_reason != "stop" or keep < len(gen.token_ids)
        # A stop on a generation_config eos that is not the end-of-turn token (Qwen's
        # <|endoftext|>) ends the conversation: the template cannot continue after it.
        # (Only a special token: an actor that strips its stop token ends a plain turn.)
        ended = (not cut_off and bool(ids) and ids[-1] not in chat.turn_end_ids
                 and ids[-1] in chat.tokenizer.all_special_ids)
        parsed = chat.parse(ids[:-1] if ended else ids)
        _record(messages, context, [assistant_message(parsed)])
        if cut_off:
            return None, Status.TRUNCATED
        if ended:
            info["ended_by"] = chat.tokenizer.convert_ids_to_tokens(ids[-1])
            return None, Status.COMPLETED

        t = time.perf_counter()
        try:
            result = await env.step(parsed)
        except RUN_FAILURES:
            raise
        except Exception as e:  # the environment itself broke
            counts["env_errors"] += 1
            info["error"] = error_text(e, "env.step")
            return None, Status.TRUNCATED
        finally:
            timings["env_s"] += time.perf_counter() - t
        counts["parse_errors"] += len(parsed.parse_errors)
        counts["tool_calls"] += len(result.tool_results)
        traj.tool_results += [(turn, r) for r in result.tool_results]
        outcomes = [r.outcome for r in result.tool_results]
        counts["tool_errors"] += outcomes.count(ToolOutcome.TOOL_ERROR)
        counts["env_errors"] += outcomes.count(ToolOutcome.ENV_ERROR)
        for r in result.tool_results:
            if r.outcome is ToolOutcome.ENV_ERROR:
                info.setdefault("error", f"tool {r.call.name}: {r.content}"[:300])
        if result.done:
            return parsed, Status.COMPLETED

        new = result.messages
        if memory.mode == "truncate_tool_output":
            new, cut = truncate_tool_outputs(new, chat.tokenizer, memory.tool_output_tokens)
            counts["tool_outputs_truncated"] += cut
        try:
            obs_ids = chat.observation_ids(context, new)
            rendered = (chat.prompt_ids([*context, *new]) if limits.history == "template"
                        else None)
        except Exception as e:  # the template raised: ids would be wrong
            info["error"] = error_text(e, "chat template")
            return None, Status.ABORTED
        _record(messages, context, new)
        room = limits.max_episode_tokens - memory.reserve_tokens  # for the context
        if memory.mode == "drop_oldest" and len(traj) + len(obs_ids) > room:
            kept = drop_oldest(context, opening, partial(_fits, chat, room))
            if kept is not None:  # else nothing can go: truncated below, as with full memory
                context = kept
                traj.start_segment(chat.prompt_ids(context), "memory_dropped")
                continue
        if rendered is not None and rendered != traj.token_ids + obs_ids:
            if len(rendered) >= limits.max_episode_tokens:
                return None, Status.TRUNCATED
            traj.start_segment(rendered, "template_history")  # the template rewrote history
            continue
        if len(traj) + len(obs_ids) >= limits.max_episode_tokens:
            return None, Status.TRUNCATED
        traj.append_observation(obs_ids)
    return None, Status.TRUNCATED


def _fits(chat: ChatFormat, room: int, context: list[dict]) -> bool:
    return len(chat.prompt_ids(context)) <= room


def _record(messages: list[dict], context: list[dict], new: list[dict]) -> None:
    """Append `new` to the conversation and, once they are apart, to the model's context."""
    messages.extend(new)
    if context is not messages:
        context.extend(new)


EpisodeFn = Callable[..., Awaitable[Trajectory]]


def load_episode_fn(path: str) -> EpisodeFn:
    """Resolve `package.module:function` (or `package.module.function`) to the loop."""
    if path == f"{__name__}:run_episode":  # tiller's own loop (the default): nothing to import
        return run_episode
    return import_dotted(path, "agent.loop")
