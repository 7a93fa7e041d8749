"""Collecting episodes: many concurrent episodes of one agent loop, driven by the engine or by
the env's scripted expert, and the rollout metrics of a set of them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tiller.envs.base import Env, Task
from tiller.errors import RunError
from tiller.observe.evaluation import is_success
from tiller.rollout.agent_loop import (
    Actor,
    EpisodeLimits,
    ExpertActor,
    derive_seed,
    run_episode,
)
from tiller.rollout.trajectory import Status, Trajectory

EpisodeFn = Callable[..., Any]  # the signature of `run_episode`


async def run_one(task: Task, k: int, actor: Actor, *, episode_fn: EpisodeFn,
                  make_env: Callable[..., Env], tokenizer: Any, limits: EpisodeLimits,
                  seed: int, tag: tuple) -> Trajectory:
    """Episode k of `task`: the env `make_env(*tag, task.id, k)` and the seed derived from
    (seed, tag, task.id, k), so its tokens depend on nothing else; the trajectory carries
    that seed."""
    episode_seed = derive_seed(seed, tag, task.id, k)
    traj = await episode_fn(make_env(*tag, task.id, k), task, actor, tokenizer,
                            seed=episode_seed, sample_index=k, limits=limits)
    return replace(traj, seed=episode_seed)


async def collect(tasks: Sequence[Task], samples: int, actor: Actor, *, episode_fn: EpisodeFn,
                  make_env: Callable[..., Env], tokenizer: Any, limits: EpisodeLimits,
                  seed: int, tag: tuple, on_done: Callable[[Trajectory], None] | None = None
                  ) -> list[Trajectory]:
    """`samples` episodes (`run_one`) of each task, all at once (the engine batches their
    turns)."""

    async def one(task: Task, k: int) -> Trajectory:
        traj = await run_one(task, k, actor, episode_fn=episode_fn, make_env=make_env,
                             tokenizer=tokenizer, limits=limits, seed=seed, tag=tag)
        if on_done is not None:
            on_done(traj)
        return traj

    return list(await asyncio.gather(*(one(t, k) for t in tasks for k in range(samples))))


def collect_expert(env_cls: type[Env], tasks: Sequence[Task], tokenizer: Any, *, guess: float,
                   limits: EpisodeLimits, seed: int, episode_fn: EpisodeFn = run_episode,
                   make_env: Callable[[int], Env] | None = None) -> list[Trajectory]:
    """The scripted expert's episodes on `tasks`, through the same loop the policy uses;
    `make_env(i)` builds episode i's env (default: the env class with plain tools)."""
    make_env = make_env or (lambda i: env_cls())

    async def one(i: int, task: Task) -> Trajectory:
        actor = ExpertActor(env_cls, task, tokenizer, guess)
        return await episode_fn(make_env(i), task, actor, tokenizer,
                                seed=derive_seed(seed, "expert", i), limits=limits)

    async def run_all() -> list[Trajectory]:
        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    return asyncio.run(run_all())


def check_aborted(trajectories: Sequence[Trajectory], max_frac: float, where: str) -> None:
    """Stop the run (RunError, one line) when more than `max_frac` of the episodes aborted (the
    engine or the loop failed: a broken engine cannot teach anything), naming the first error
    the loop recorded (`info["error"]`)."""
    aborted = [t for t in trajectories if t.status is Status.ABORTED]
    if len(aborted) > max_frac * len(trajectories):
        first = aborted[0].info.get("error", "aborted without an error recorded")
        raise RunError(f"{where}: {len(aborted)} of {len(trajectories)} episodes aborted "
                       f"(rl.max_aborted_frac={max_frac}); first error: {first}")


def rollout_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Means over the episodes; `reward/<check>` is each verifier check's mean (the reward's
    breakdown: format, arguments, answer...), an episode without that check counting 0 (an
    episode whose reset or verifier failed has only `reset_error` / `verifier_error`)."""
    n = max(len(trajs), 1)
    statuses = [t.status for t in trajs]
    checks = sorted({k for t in trajs for k in t.reward.checks})
    return {
        **{f"reward/{k}": sum(t.reward.checks.get(k, 0.0) for t in trajs) / n for k in checks},
        "reward_mean": sum(t.reward.value for t in trajs) / n,
        "success_rate": sum(is_success(t) for t in trajs) / n,
        "response_tokens_mean": sum(t.num_generated for t in trajs) / n,
        "episode_tokens_mean": sum(len(t.token_ids) for t in trajs) / n,
        "turns_mean": sum(t.num_turns for t in trajs) / n,
        "tool_calls_per_episode": sum(t.tool_calls for t in trajs) / n,
        "tool_errors_per_episode": sum(t.tool_errors for t in trajs) / n,
        "tool_parse_failures": float(sum(t.parse_errors for t in trajs)),
        "tool_outputs_truncated": float(sum(t.tool_outputs_truncated for t in trajs)),
        "memory_drops_per_episode": sum(t.split_reasons.count("memory_dropped")
                                        for t in trajs) / n,
        "env_error_rate": statuses.count(Status.ENV_ERROR) / n,
        "truncated_rate": statuses.count(Status.TRUNCATED) / n,
        "aborted_rate": statuses.count(Status.ABORTED) / n,
    }
