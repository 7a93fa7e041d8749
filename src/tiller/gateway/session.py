"""One episode's session: the chat completion calls of an agent program, assembled into one
trajectory token in, token out.

The first call's prompt is rendered from its messages (`ChatFormat.prompt_ids`). A later call
whose messages *extend* the last call's messages plus the reply the gateway gave (compared as
the chat template renders them, never by re-tokenizing) continues the same exact sequence: its
prompt IS the token stream so far (prompt, engine ids, bridges) plus the bridge
`ChatFormat.observation_ids(history, new messages)`. Any other call starts a new exact
sequence (`TrajectoryBuilder.start_segment`) from its own rendered prompt, and the reason is
kept with the split:

    history_rewritten  the agent dropped or edited earlier messages (or the reply)
    tools_changed      the call's tool schemas differ from the last call's
    unclosed_turn      the last turn did not end with the end-of-turn token (cut at a length
                       limit, or ended by another stop token): no bridge continues it exactly
    bridge_failed      the chat format could not compute the bridge after the last turn (the
                       template did not render the turn's marker or its end-of-turn token;
                       logged with the reason): the call's prompt is rendered afresh

Nothing is appended until the engine answered, so a call the gateway refuses or the engine
fails leaves the trajectory as it was, and the agent may retry it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from tiller.engine.api import Generation
from tiller.envs.actions import ParsedTurn
from tiller.rollout.agent_loop import Actor, EpisodeLimits
from tiller.rollout.chat import ChatFormat
from tiller.rollout.trajectory import TrajectoryBuilder
from tiller.seeds import derive_seed

logger = logging.getLogger(__name__)

SPLIT_REASONS = ("history_rewritten", "tools_changed", "unclosed_turn", "bridge_failed")


@dataclass(frozen=True)
class Plan:
    """How one call's prompt is made: `prompt` is what the engine continues; `added` the ids
    the trajectory gains before the generated ones (the whole prompt for the first call or a
    split, else the bridge); `kind` is "first", "extend" or the split reason."""

    prompt: list[int]
    added: list[int]
    kind: str


class Session:
    """The state of one episode's session, changed only by the gateway's chat route (one call
    at a time) and read by the episode once the session is closed."""

    def __init__(self, key: str, actor: Actor, tokenizer: Any, *, task_id: str,
                 sample_index: int, seed: int, limits: EpisodeLimits,
                 loop: asyncio.AbstractEventLoop):
        self.key, self.actor, self.tokenizer = key, actor, tokenizer
        self.limits, self.loop = limits, loop
        self.seed = seed
        self.engine_session = f"{task_id}/{sample_index}/{seed}"  # the engine's KV key
        self.builder = TrajectoryBuilder(task_id, sample_index)
        self.history: list[dict[str, Any]] | None = None  # last call's messages + its reply
        self.tools: list[dict] | None = None
        self.closed_turn = False  # the last turn ends with the end-of-turn token
        self.calls = 0  # calls that reached the engine
        self.rejected = 0  # calls answered 4xx/5xx
        self.tool_calls = self.parse_errors = 0
        self.final: ParsedTurn | None = None  # the last turn, when the model finished it
        self.last_cut = False  # the last turn was cut at a length limit
        self.refused: str | None = None  # why a call was refused for the episode's limits
        self.aborted: str | None = None  # why the engine failed or aborted a turn
        self.run_failure: BaseException | None = None  # a ConfigError/RunError: stops the run
        self.generate_s = 0.0
        self.busy = False
        self.ended = False
        self.inflight: concurrent.futures.Future | None = None

    def plan(self, chat: ChatFormat, messages: list[dict[str, Any]], tools: list[dict] | None
             ) -> Plan:
        """The prompt of a call with `messages` and `tools` (template form)."""
        if self.history is None:
            ids = chat.prompt_ids(messages)
            return Plan(ids, ids, "first")
        reason = self._split_reason(messages, tools)
        if reason is None:
            try:
                bridge = chat.observation_ids(self.history, messages[len(self.history):])
            except ValueError as e:  # the template did not render what the bridge needs
                logger.warning("gateway session %s: no bridge after its last turn (%s); the "
                               "call starts a new exact sequence", self.engine_session, e)
                reason = "bridge_failed"
            else:
                return Plan(self.builder.token_ids + bridge, bridge, "extend")
        ids = chat.prompt_ids(messages)
        return Plan(ids, ids, reason)

    def _split_reason(self, messages: list[dict[str, Any]], tools: list[dict] | None
                      ) -> str | None:
        assert self.history is not None
        if tools != self.tools:
            return "tools_changed"
        if messages[: len(self.history)] != self.history:
            return "history_rewritten"
        if not self.closed_turn:
            return "unclosed_turn"
        return None

    async def generate(self, prompt: list[int], messages: list[dict[str, Any]]) -> Generation:
        """The actor's turn after `prompt`, run on the episode's event loop (where the actor
        and its engine requests live); the seed is derived from the episode's and the call's
        index, so a deterministic program gets the same tokens on a rerun. Cancelled when the
        session is closed (CancelledError)."""
        seed = derive_seed(self.seed, self.calls)
        self.calls += 1
        t = time.perf_counter()
        future = asyncio.run_coroutine_threadsafe(
            self.actor.act(prompt, messages, seed, session_id=self.engine_session), self.loop)
        self.inflight = future
        try:
            return await asyncio.wrap_future(future)
        finally:
            self.inflight = None
            self.generate_s += time.perf_counter() - t

    def commit(self, plan: Plan, gen: Generation, keep: int, chat: ChatFormat,
               messages: list[dict[str, Any]], tools: list[dict] | None
               ) -> tuple[Generation, ParsedTurn]:
        """Append the call to the trajectory: the plan's ids, then the engine's first `keep`
        ids as generated (the rest are counted as discarded). Returns the kept generation and
        its parse (without a final stop token that is not the end-of-turn token)."""
        kept = replace(gen, token_ids=gen.token_ids[:keep], logprobs=gen.logprobs[:keep],
                       versions=tuple(gen.versions[:keep]),
                       finish_reason="length" if keep < len(gen.token_ids) else
                       gen.finish_reason)
        b = self.builder
        if plan.kind == "first":
            b.append_prompt(plan.added)
        elif plan.kind == "extend":
            b.append_observation(plan.added)
        else:
            b.start_segment(plan.added, plan.kind)
        b.discarded_tokens += len(gen.token_ids) - keep
        ids = kept.token_ids
        b.append_generated(ids, kept.logprobs, list(kept.versions) or kept.version)
        eot = chat.end_of_turn_id
        stopped = kept.finish_reason == "stop" and bool(ids)
        # a stop on another special token (an eos that is not the end-of-turn token) ends the
        # turn too, but the template cannot continue after it: parse without it
        other_stop = (stopped and ids[-1] != eot
                      and ids[-1] in chat.tokenizer.all_special_ids)
        turn = chat.parse(ids[:-1] if other_stop else ids)
        self.closed_turn = stopped and ids[-1] == eot
        self.last_cut = kept.finish_reason == "length"
        self.final = turn if stopped else None
        self.tool_calls += len(turn.tool_calls)
        self.parse_errors += len(turn.parse_errors)
        self.tools = tools
        return kept, turn

    def remember(self, messages: list[dict[str, Any]], reply: dict[str, Any]) -> None:
        """The history the next call must extend: this call's messages and the reply as the
        agent will send it back (template form)."""
        self.history = [*messages, reply]
