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
from collections.abc import Awaitable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from tiller.engine.api import Engine, Generation, SamplingParams
from tiller.envs.actions import ParsedTurn, assistant_message
from tiller.envs.base import Env, StepResult, Task
from tiller.errors import ConfigError, import_dotted
from tiller.rollout.chat import FAMILIES, ChatFormat, end_of_turn_token
from tiller.rollout.episode import RUN_FAILURES, Outcome, error_text, record_abort, run_in_env
from tiller.rollout.memory import MemoryPolicy, drop_oldest, truncate_tool_outputs
from tiller.rollout.trajectory import Status, Trajectory, TrajectoryBuilder
from tiller.seeds import derive_seed
from tiller.tools.registry import ToolOutcome

logger = logging.getLogger(__name__)


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
    """Run one episode and verify it (`episode.run_in_env`); `env.close` always runs.

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
    traj = TrajectoryBuilder(task.id, sample_index)
    traj.timings.update(generate_s=0.0, env_s=0.0)
    turns = _Turns(env, actor, tokenizer, traj, limits, seed,
                   session_id=f"{task.id}/{sample_index}/{seed}")
    return await run_in_env(env, task, seed, traj, turns.play)


End = tuple[ParsedTurn | None, Status]  # how the turns ended: the final answer and the status


@dataclass
class _Turns:
    """The turns of `run_episode`: generate, parse, step, append the observation. `messages`
    records the whole conversation; `context` is what the model sees, which differs from it
    once `drop_oldest` memory dropped exchanges (a new exact sequence starts there). With
    `history="template"` each next context is the template's rendering of it; where that is
    not the sampled stream plus the observation (a template that drops earlier reasoning), a
    new exact sequence starts from the rendering."""

    env: Env
    actor: Actor
    tokenizer: PreTrainedTokenizerBase
    traj: TrajectoryBuilder
    limits: EpisodeLimits
    seed: int
    session_id: str
    messages: list[dict] = field(default_factory=list)  # set by `play`
    context: list[dict] = field(default_factory=list)
    opening: int = 0  # messages env.reset opened with: `drop_oldest` keeps them
    chat: ChatFormat = field(init=False)

    async def play(self, messages: list[dict]) -> Outcome:
        """The episode's body after `env.reset` gave the opening `messages` (kept as the
        conversation): the turns' outcome, ABORTED when the loop itself broke."""
        self.messages = self.context = messages
        self.opening = len(messages)
        try:
            self.chat = ChatFormat(self.tokenizer, self.env.tool_schemas(),
                                   self.limits.chat_format)
            self.traj.append_prompt(self.chat.prompt_ids(messages))
            final, status = await self._run()
        except RUN_FAILURES:
            raise
        except Exception as e:  # the loop broke (template, tokenizer, a generation's shape)
            record_abort(self.traj, e, "agent loop", "the agent loop broke")
            return Outcome(Status.ABORTED, messages=messages)
        return Outcome(status, final, messages)

    async def _run(self) -> End:
        for turn in range(self.limits.max_turns):
            end = await self._turn(turn)
            if end is not None:
                return end
        return None, Status.TRUNCATED

    async def _turn(self, turn: int) -> End | None:
        """One turn; how the episode ended, or None when it goes on."""
        traj, chat = self.traj, self.chat
        try:
            with traj.timed("generate_s"):
                gen = await self.actor.act(traj.token_ids, self.context,
                                           derive_seed(self.seed, turn),
                                           session_id=self.session_id)
        except RUN_FAILURES:
            raise
        except Exception as e:
            traj.info["error"] = error_text(e, "engine")
            return None, Status.ABORTED
        keep = max(0, self.limits.max_episode_tokens - len(traj))
        ids = gen.token_ids[:keep]
        traj.discarded_tokens += len(gen.token_ids) - len(ids)
        # each token keeps the version that sampled it; the turn counts as its oldest
        traj.append_generated(ids, gen.logprobs[:keep], list(gen.versions[:keep]) or gen.version)
        if gen.finish_reason == "abort":  # a partial turn (abort, or an aborting weight update)
            traj.info["error"] = "engine: the request was aborted mid-turn"
            return None, Status.ABORTED
        cut_off = gen.finish_reason != "stop" or keep < len(gen.token_ids)
        # A stop on a generation_config eos that is not the end-of-turn token (Qwen's
        # <|endoftext|>) ends the conversation: the template cannot continue after it.
        # (Only a special token: an actor that strips its stop token ends a plain turn.)
        ended = (not cut_off and bool(ids) and ids[-1] not in chat.turn_end_ids
                 and ids[-1] in chat.tokenizer.all_special_ids)
        parsed = chat.parse(ids[:-1] if ended else ids)
        self._record([assistant_message(parsed)])
        if cut_off:
            return None, Status.TRUNCATED
        if ended:
            traj.info["ended_by"] = chat.tokenizer.convert_ids_to_tokens(ids[-1])
            return None, Status.COMPLETED
        result = await self._step(parsed, turn)
        if result is None:
            return None, Status.TRUNCATED
        if result.done:
            return parsed, Status.COMPLETED
        return self._observe(result.messages)

    async def _step(self, parsed: ParsedTurn, turn: int) -> StepResult | None:
        """`env.step(parsed)`, its tool calls counted; None when the env itself broke."""
        traj = self.traj
        try:
            with traj.timed("env_s"):
                result = await self.env.step(parsed)
        except RUN_FAILURES:
            raise
        except Exception as e:  # the environment itself broke
            traj.counts["env_errors"] += 1
            traj.info["error"] = error_text(e, "env.step")
            return None
        traj.counts["parse_errors"] += len(parsed.parse_errors)
        traj.counts["tool_calls"] += len(result.tool_results)
        traj.tool_results += [(turn, r) for r in result.tool_results]
        outcomes = [r.outcome for r in result.tool_results]
        traj.counts["tool_errors"] += outcomes.count(ToolOutcome.TOOL_ERROR)
        traj.counts["env_errors"] += outcomes.count(ToolOutcome.ENV_ERROR)
        for r in result.tool_results:
            if r.outcome is ToolOutcome.ENV_ERROR:
                traj.info.setdefault("error", f"tool {r.call.name}: {r.content}"[:300])
        return result

    def _observe(self, new: list[dict]) -> End | None:
        """Append the observation `new` (or start a new exact sequence); how the episode
        ended when it does not fit, else None."""
        traj, chat, limits, memory = self.traj, self.chat, self.limits, self.limits.memory
        if memory.mode == "truncate_tool_output":
            new, cut = truncate_tool_outputs(new, chat.tokenizer, memory.tool_output_tokens)
            traj.counts["tool_outputs_truncated"] += cut
        try:
            obs_ids = chat.observation_ids(self.context, new)
            rendered = (chat.prompt_ids([*self.context, *new]) if limits.history == "template"
                        else None)
        except Exception as e:  # the template raised: ids would be wrong
            traj.info["error"] = error_text(e, "chat template")
            return None, Status.ABORTED
        self._record(new)
        room = limits.max_episode_tokens - memory.reserve_tokens  # for the context
        if memory.mode == "drop_oldest" and len(traj) + len(obs_ids) > room:
            kept = drop_oldest(self.context, self.opening, partial(_fits, chat, room))
            if kept is not None:  # else nothing can go: truncated below, as with full memory
                self.context = kept
                traj.start_segment(chat.prompt_ids(kept), "memory_dropped")
                return None
        if rendered is not None and rendered != traj.token_ids + obs_ids:
            if len(rendered) >= limits.max_episode_tokens:
                return None, Status.TRUNCATED
            traj.start_segment(rendered, "template_history")  # the template rewrote history
            return None
        if len(traj) + len(obs_ids) >= limits.max_episode_tokens:
            return None, Status.TRUNCATED
        traj.append_observation(obs_ids)
        return None

    def _record(self, new: list[dict]) -> None:
        """Append `new` to the conversation and, once they are apart, to the model's
        context."""
        self.messages.extend(new)
        if self.context is not self.messages:
            self.context.extend(new)


def _fits(chat: ChatFormat, room: int, context: list[dict]) -> bool:
    return len(chat.prompt_ids(context)) <= room


class EpisodeFn(Protocol):
    """The episode hook (`agent.loop`, and the gateway's `ProgramEpisode`): one episode of
    `task` in `env`, its turns written by `actor`; `run_episode` is tiller's own. tiller
    always passes `limits`; `sample_index` only for the policy's episodes."""

    def __call__(self, env: Env, task: Task, actor: Actor, tokenizer: PreTrainedTokenizerBase,
                 *, seed: int, limits: EpisodeLimits, sample_index: int = 0
                 ) -> Awaitable[Trajectory]: ...


def load_episode_fn(path: str) -> EpisodeFn:
    """Resolve `package.module:function` (or `package.module.function`) to the loop."""
    if path == f"{__name__}:run_episode":  # tiller's own loop (the default): nothing to import
        return run_episode
    return import_dotted(path, "agent.loop")
