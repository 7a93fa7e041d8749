"""The episode shell: what every episode does around its turns, whoever writes them (tiller's
agent loop, `rollout.agent_loop`, or an agent program through the gateway,
`gateway.program`): reset the env, run the turns, score the episode, close the env, and turn
what failed into a status.

    reset      fails: the env's error (ENV_ERROR, reward 0 with check `reset_error`)
    turns      the body: returns an `Outcome` (its status so far, the final answer, the
               conversation and, when it scored the episode itself, the reward)
    verify     `env.verify(final)` unless the body gave the reward; a verifier that raises or
               reports `env_error` is the env's error (check `verifier_error`)
    close      always runs; a failure is logged and recorded as `info["close_error"]`

An env error (reset, a step, a tool or the verifier: `counts["env_errors"]`) marks the reward
`env_error` and the status ENV_ERROR, unless the episode ABORTED (the engine or the loop
failed), which wins so that `rl.max_aborted_frac` sees it. A `ConfigError` or `RunError` from
any part is the run's problem, not the episode's: it propagates (after `env.close`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Env, Task
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError, RunError
from tiller.rollout.trajectory import Status, Trajectory, TrajectoryBuilder

logger = logging.getLogger(__name__)
_logged: set[tuple[str, type[BaseException]]] = set()  # (where, type) whose traceback was logged

# The run's own configuration or state is broken (a sandbox that refuses to start, fail-closed):
# every episode would fail the same way, so these stop the run instead of scoring an episode.
RUN_FAILURES = (ConfigError, RunError)


def error_text(e: BaseException, where: str) -> str:
    """How an episode records a failure in `info`: where, the exception type, its message."""
    return f"{where}: {type(e).__name__}: {e}"


@dataclass(frozen=True)
class Outcome:
    """How an episode's turns ended: the status so far, the final answer the verifier scores
    (None unless the policy finished), the whole conversation, and the reward when the turns
    scored the episode themselves (`agent.reward: program`; None: the env's verifier)."""

    status: Status
    final: ParsedTurn | None = None
    messages: Sequence[dict[str, Any]] = ()
    reward: Reward | None = None


Body = Callable[[list[dict[str, Any]]], Awaitable[Outcome]]  # the turns, after env.reset


async def run_in_env(env: Env, task: Task, seed: int, traj: TrajectoryBuilder,
                     body: Body) -> Trajectory:
    """One episode of `task` in `env`: reset, `body(opening messages)`, verify, close (see the
    module docstring); `traj` holds the body's tokens, counts, info and timings, and gets
    `timings["total_s"]`."""
    t0 = time.perf_counter()
    outcome = Outcome(Status.TRUNCATED)
    try:
        try:
            opening = await env.reset(task, seed)
        except RUN_FAILURES:
            raise
        except Exception as e:  # the environment itself broke: nothing to verify
            traj.counts["env_errors"] += 1
            traj.info["error"] = error_text(e, "env.reset")
            reward = Reward(0.0, {"reset_error": 1.0})
        else:
            outcome = await body(opening)
            reward = (outcome.reward if outcome.reward is not None
                      else await _verify(env, outcome.final, traj))
    finally:
        await _close(env, traj)
    status = outcome.status
    if traj.counts["env_errors"]:
        reward = replace(reward, env_error=True)
        if status is not Status.ABORTED:  # an abort is counted against rl.max_aborted_frac
            status = Status.ENV_ERROR
    traj.timings["total_s"] = time.perf_counter() - t0
    return traj.finish(reward, status, messages=outcome.messages)


async def _verify(env: Env, final: ParsedTurn | None, traj: TrajectoryBuilder) -> Reward:
    """The env's verifier on `final`; its failure (raised or reported) is an env error."""
    try:
        reward = await env.verify(final)
    except RUN_FAILURES:
        raise
    except Exception as e:  # a broken checker (sandbox down, ...) is the env's failure
        traj.counts["env_errors"] += 1
        traj.info.setdefault("error", error_text(e, "env.verify"))
        return Reward(0.0, {"verifier_error": 1.0})
    if reward.env_error:  # the verifier says its own check could not run
        traj.counts["env_errors"] += 1
        why = reward.error or "the verifier reported env_error"
        traj.info.setdefault("error", f"env.verify: {why}")
    return reward


async def _close(env: Env, traj: TrajectoryBuilder) -> None:
    try:
        await env.close()
    except Exception as e:  # the episode is sound; the leak is logged and recorded
        traj.info["close_error"] = error_text(e, "env.close")
        logger.warning("task %s sample %d: %s", traj.task_id, traj.sample_index,
                       traj.info["close_error"])


def record_abort(traj: TrajectoryBuilder, e: Exception, where: str, what: str,
                 max_chars: int | None = None) -> None:
    """An exception that aborts the episode: `info["error"]` (cut to `max_chars`), and its
    traceback logged once per (where, exception type), as a bug's would be."""
    traj.info["error"] = error_text(e, where)[:max_chars]
    if (where, type(e)) not in _logged:
        _logged.add((where, type(e)))
        logger.exception("task %s sample %d: %s; the episode is aborted", traj.task_id,
                         traj.sample_index, what)
