"""`agent.program`: the user's async agent function as the episode, through the gateway.

    async def main(base_url: str, api_key: str, model: str, task: dict) -> Any

is awaited once per episode (keyword arguments) with the gateway's `base_url` (".../v1"), the
episode's session key as `api_key`, the served `model` name and the task as plain data:
`{"id", "prompt", "system", "messages", "tools"}` (the env's opening messages and tool schemas
in OpenAI's shape; the answer is not given). Its chat completion calls become the trajectory
(`tiller.gateway.session`). The reward (`agent.reward`):

    verifier  the env's verifier on the model's last turn (`env.verify(final)`; None when that
              turn was cut off or the episode aborted); what the program returns is ignored
    program   what the program returns: a number (a bool counts as 0/1) or a mapping with a
              numeric "reward" (its other numeric entries become the reward's checks)

Status: ABORTED when the program raised, ran past `agent.program_timeout_s`, returned a reward
that is not one, made no call, or the engine failed or aborted a turn (`info["error"]` says
which; counted against rl.max_aborted_frac); TRUNCATED when the last turn was cut at a length
limit or a call was refused for the episode's turn or token limit; ENV_ERROR when the env's
reset or verifier failed; else COMPLETED.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiller.envs.base import Env, Task
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError, import_dotted, require_package
from tiller.rollout.agent_loop import Actor, EpisodeLimits
from tiller.rollout.episode import RUN_FAILURES, Outcome, record_abort, run_in_env
from tiller.rollout.trajectory import Status, Trajectory, TrajectoryBuilder

if TYPE_CHECKING:  # the gateway needs FastAPI and uvicorn (the serve extra)
    from tiller.gateway.server import Gateway
    from tiller.gateway.session import Session

PROGRAM_ARGS = ("base_url", "api_key", "model", "task")


def load_program(path: str) -> Callable[..., Any]:
    """The `async def` at `path`, checked to accept the program's keyword arguments (a
    ConfigError naming agent.program otherwise), and the gateway's packages installed."""
    for module in ("fastapi", "uvicorn"):
        require_package(module, "serve", "agent.program (the gateway)")
    fn = import_dotted(path, "agent.program")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"config field agent.program: got {path!r}; expected an async "
                          "function (async def main(base_url, api_key, model, task))")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(PROGRAM_ARGS))
    except TypeError as e:
        raise ConfigError(f"config field agent.program: got {path!r}; it must accept the "
                          f"keyword arguments {', '.join(PROGRAM_ARGS)} ({e})") from e
    return fn


def program_reward(result: Any) -> Reward:
    """The reward a program returned (`agent.reward: program`); ValueError if it is none."""
    value, checks = result, {}
    if isinstance(result, Mapping):
        value = result.get("reward")
        checks = {k: float(v) for k, v in result.items()
                  if k != "reward" and isinstance(v, (int, float))}
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"agent.reward=program: the program returned {result!r:.200}; "
                         'expected a finite number or a mapping with a numeric "reward"')
    return Reward(float(value), checks)


@dataclass
class ProgramEpisode:
    """The episode function (`EpisodeFn`) that runs `program` per episode, inside the episode
    shell (`rollout.episode.run_in_env`: reset, verify, close and the env-error rules)."""

    gateway: Gateway
    program: Callable[..., Any]
    timeout_s: float
    reward_source: str  # "verifier" or "program"

    async def __call__(self, env: Env, task: Task, actor: Actor, tokenizer: Any, *, seed: int,
                       limits: EpisodeLimits, sample_index: int = 0) -> Trajectory:
        traj = TrajectoryBuilder(task.id, sample_index)
        traj.timings["generate_s"] = 0.0

        async def play(messages: list[dict[str, Any]]) -> Outcome:
            session = self.gateway.open(actor, tokenizer, traj, seed=seed, limits=limits)
            view = {"id": task.id, "prompt": task.prompt, "system": task.system,
                    "messages": [dict(m) for m in messages], "tools": env.tool_schemas()}
            return await self._play(session, view)

        return await run_in_env(env, task, seed, traj, play)

    async def _play(self, session: Session, view: dict[str, Any]) -> Outcome:
        """Run the program on the task `view` in `session`, then close the session."""
        traj, result = session.builder, None
        try:
            result = await asyncio.wait_for(
                self.program(base_url=self.gateway.base_url, api_key=session.key,
                             model=self.gateway.model, task=view), self.timeout_s)
        except asyncio.TimeoutError:
            traj.info["error"] = (f"agent.program: did not return within {self.timeout_s:g} s "
                                  "(agent.program_timeout_s)")
        except RUN_FAILURES:
            raise
        except Exception as e:  # the program's own failure: the episode is aborted
            record_abort(traj, e, "agent.program", "the agent program raised", max_chars=500)
        finally:
            self.gateway.close_session(session)
        if session.run_failure is not None:
            raise session.run_failure
        return self._outcome(session, result)

    def _outcome(self, session: Session, result: Any) -> Outcome:
        """The status of a closed session, and the reward when the program gives it."""
        info = session.builder.info
        if session.aborted is not None:
            info.setdefault("error", session.aborted)
        if session.history is None and "error" not in info:
            info["error"] = "agent.program made no chat completion call that was answered"
        if session.rejected:
            info["gateway_rejected"] = str(session.rejected)
        if session.refused is not None:
            info["truncated"] = session.refused
        # an engine failure is the run's to count (rl.max_aborted_frac); a limit the policy
        # ran into is truncation even when the program then raised on the refusal
        truncated = session.refused is not None or session.last_cut
        status = (Status.ABORTED if session.aborted is not None else
                  Status.TRUNCATED if truncated and session.history is not None else
                  Status.ABORTED if "error" in info else Status.COMPLETED)
        messages = session.history or []
        if self.reward_source != "program":  # the env's verifier scores the last turn
            final = session.final if status is not Status.ABORTED else None
            return Outcome(status, final, messages)
        no_reward = Reward(0.0, {"no_program_reward": 1.0})
        if "error" in info:  # aborted, or truncated and the program raised on the refusal
            return Outcome(status, None, messages, no_reward)
        try:
            return Outcome(status, None, messages, program_reward(result))
        except ValueError as e:
            info["error"] = str(e)
            return Outcome(Status.ABORTED, None, messages, no_reward)
