"""tiller's agent loop, except that the first episode to start in a Ray rollout worker after
the marker file (`TILLER_TEST_KILL_MARKER`) is armed kills engine server 0's Ray actor
(`ray.kill`), or with TILLER_TEST_KILL_HOW=process SIGKILLs the server process itself (its
actor lives on), its server's process group id written to the marker (`agent.loop:
kill_server_loop:run_episode`; tests/test_ray_servers.py). One kill per run: the marker file is
created once. In the run's own process (evaluation) nothing is killed.

So that a request of this worker is on server 0 when it dies, whatever the load: the server is
first stopped (SIGSTOP), and after `SETTLE_S`, in which the worker reads any answer it sent
before that, this episode starts and the kill follows `SETTLE_S` later. Either a request of the
worker is then in flight on server 0 (unanswerable: the server is stopped) or the episode's
first turn went there (the router's pick: the fewest in flight, server 0 first of equals); both
fail and are retried on server 1. A request the server answered just before a plain SIGKILL
would leave neither (seen once in CI: `engine/retries` 0)."""

import asyncio
import os
import signal

import ray

from tiller.engine.ray_servers import ACTOR_PREFIX
from tiller.rollout.agent_loop import run_episode as tiller_episode

MARKER_ENV = "TILLER_TEST_KILL_MARKER"
SETTLE_S = 1.0  # stopped server: the answers it sent are read; then the episode's first pick


async def run_episode(env, task, actor, tokenizer, *, seed, limits, sample_index=0):
    marker = os.environ.get(MARKER_ENV)
    in_worker = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    if marker and in_worker and sample_index == 1:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass  # killed once already
        else:
            (name,) = [n for n in ray.util.list_named_actors()  # tiller-server-<name>-0-<tag>
                       if n.startswith(ACTOR_PREFIX) and n.rsplit("-", 2)[-2] == "0"]
            server = ray.get_actor(name)
            pid = await server.pid.remote()  # the server's, its process group's id
            os.write(fd, str(pid).encode())
            os.close(fd)
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(SETTLE_S)
            episode = asyncio.create_task(tiller_episode(
                env, task, actor, tokenizer, seed=seed, limits=limits, sample_index=sample_index))
            await asyncio.sleep(SETTLE_S)
            if os.environ.get("TILLER_TEST_KILL_HOW") == "process":
                os.kill(pid, signal.SIGKILL)
            else:
                ray.kill(server, no_restart=True)
            return await episode
    return await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                sample_index=sample_index)
