"""Collecting episodes: many concurrent episodes of one agent loop, driven by the engine or by
the env's scripted expert, and the rollout metrics of a set of them."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tiller.envs.base import Env, Task
from tiller.errors import RunError
from tiller.rollout.agent_loop import (
    Actor,
    EpisodeLimits,
    ExpertActor,
    derive_seed,
    run_episode,
)
from tiller.rollout.trajectory import Status, Trajectory, is_success

EpisodeFn = Callable[..., Any]  # the signature of `run_episode`


async def run_one(task: Task, k: int, actor: Actor, *, episode_fn: EpisodeFn,
                  make_env: Callable[..., Env], tokenizer: Any, limits: EpisodeLimits,
                  seed: int, tag: tuple, draw: int = 0) -> Trajectory:
    """Episode k of the `draw`-th draw of `task` under `tag`: the env `make_env(*tag, inst, k)`
    and the seed derived from (seed, tag, inst, k), so its tokens depend on nothing else;
    inst is the task id, with `#draw` for a repeated draw (its own seeds and replay keys).
    The trajectory carries that seed, draw and tag."""
    inst = task.id if draw == 0 else f"{task.id}#{draw}"
    episode_seed = derive_seed(seed, tag, inst, k)
    traj = await episode_fn(make_env(*tag, inst, k), task, actor, tokenizer,
                            seed=episode_seed, sample_index=k, limits=limits)
    return replace(traj, seed=episode_seed, draw=draw, tag=tuple(tag))


def draws(tasks: Sequence[Task]) -> list[int]:
    """Each task's draw index in the list: 0 the first time its id appears, then 1, 2..."""
    seen: Counter[str] = Counter()
    out = []
    for t in tasks:
        out.append(seen[t.id])
        seen[t.id] += 1
    return out


async def collect(tasks: Sequence[Task], samples: int, actor: Actor, *, episode_fn: EpisodeFn,
                  make_env: Callable[..., Env], tokenizer: Any, limits: EpisodeLimits,
                  seed: int, tag: tuple, on_done: Callable[[Trajectory], None] | None = None
                  ) -> list[Trajectory]:
    """`samples` episodes (`run_one`) of each task, all at once (the engine batches their
    turns); a task listed twice is two draws, each with its own samples."""

    async def one(task: Task, draw: int, k: int) -> Trajectory:
        traj = await run_one(task, k, actor, episode_fn=episode_fn, make_env=make_env,
                             tokenizer=tokenizer, limits=limits, seed=seed, tag=tag, draw=draw)
        if on_done is not None:
            on_done(traj)
        return traj

    pairs = zip(tasks, draws(tasks), strict=True)
    return list(await asyncio.gather(*(one(t, d, k) for t, d in pairs for k in range(samples))))


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
    n = max(len(trajs), 1)
    statuses = [t.status for t in trajs]
    return {**check_means(trajs),
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


def check_means(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """`check/<name>`: the mean of each verifier check over the episodes that report it."""
    values: dict[str, list[float]] = {}
    for t in trajs:
        for name, v in t.reward.checks.items():
            values.setdefault(name, []).append(float(v))
    return {f"check/{name}": sum(vs) / len(vs) for name, vs in sorted(values.items())}
