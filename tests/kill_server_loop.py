"""tiller's agent loop, except that the first episode to start in a Ray rollout worker after
the marker file (`TILLER_TEST_KILL_MARKER`) is armed kills engine server 0's Ray actor
(`ray.kill`), or with TILLER_TEST_KILL_HOW=process SIGKILLs the server process itself (its
actor lives on), while the worker's episodes are in flight, its server's process group id
written to the marker, then runs on (`agent.loop:
kill_server_loop:run_episode`; tests/test_ray_servers.py). One kill per run: the marker file is
created once. In the run's own process (evaluation) nothing is killed."""

import asyncio
import os
import signal

import ray

from tiller.engine.ray_servers import ACTOR_PREFIX
from tiller.rollout.agent_loop import run_episode as tiller_episode

MARKER_ENV = "TILLER_TEST_KILL_MARKER"


async def run_episode(env, task, actor, tokenizer, *, seed, limits, sample_index=0):
    marker = os.environ.get(MARKER_ENV)
    in_worker = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    if marker and in_worker and sample_index == 1:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass  # killed once already
        else:
            await asyncio.sleep(0.2)  # the other episodes' first turns are on the servers
            (name,) = [n for n in ray.util.list_named_actors()  # tiller-server-<name>-0-<tag>
                       if n.startswith(ACTOR_PREFIX) and n.rsplit("-", 2)[-2] == "0"]
            server = ray.get_actor(name)
            pid = await server.pid.remote()  # the server's, its process group's id
            os.write(fd, str(pid).encode())
            os.close(fd)
            if os.environ.get("TILLER_TEST_KILL_HOW") == "process":
                os.kill(pid, signal.SIGKILL)
            else:
                ray.kill(server, no_restart=True)
    return await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                sample_index=sample_index)
