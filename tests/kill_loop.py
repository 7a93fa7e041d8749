"""tiller's agent loop, except that the first episode to start in a Ray rollout worker after
`KILL["marker"]` is armed kills that worker with `ray.kill` while its other episodes are in
flight (`agent.loop: kill_loop:run_episode`; tests/test_ray.py). The marker file, created
once, makes it one kill per run across the workers; in the run's own process (evaluation)
nothing is killed."""

import asyncio
import os

import ray

from tiller.rollout.agent_loop import run_episode as tiller_episode

MARKER_ENV = "TILLER_TEST_KILL_MARKER"  # the file whose creation arms one kill


async def run_episode(env, task, actor, tokenizer, *, seed, limits, sample_index=0):
    marker = os.environ.get(MARKER_ENV)
    in_worker = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    if marker and in_worker and sample_index == 1:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass  # killed once already
        else:
            await asyncio.sleep(0.3)  # the worker's other episodes are in flight
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            await asyncio.sleep(60)  # the kill ends this process first
    return await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                sample_index=sample_index)
