"""tiller's agent loop, except that the first episode of sample index 1 to start in a Ray
rollout worker after the marker file (`TILLER_TEST_KILL_MARKER`) is armed kills engine server
0's Ray actor (`ray.kill`), or with TILLER_TEST_KILL_HOW=process SIGKILLs the server process
itself (its actor lives on), its server's process group id written to the marker
(`agent.loop: kill_server_loop:run_episode`; tests/test_ray_servers.py). One kill per run: the
marker file is created once. In the run's own process (evaluation) nothing is killed.

So that a request of this worker meets the dead server, whatever the timing: the episode's
session is pinned to server 0 in the worker's router (as if its earlier turns had gone there),
the server is killed and the episode waits until its process is gone (`ray.kill` only asks Ray),
so its first turn is sent to a dead server 0 unless a failure there already marked it down
(itself a retry); the episode then checks that its worker's engine counted a failed request
since the pin. With no pin, answers the server sent just before the kill could leave no request
to fail, and the first pick could go to server 1 (seen once in CI: `engine/retries` 0). The run
must be `rl.mode: sync` (`kill_run` sets it): with weight pushes during rollouts, a push could
find server 0 dead first and its router state (server 0 down) reach this worker before the
episode's first turn, which would then move to server 1 without a retry."""

import asyncio
import os
import signal

import ray
from helpers import gone

from tiller.engine.ray_servers import ACTOR_PREFIX
from tiller.rollout.agent_loop import run_episode as tiller_episode

MARKER_ENV = "TILLER_TEST_KILL_MARKER"
GONE_TIMEOUT_S = 60.0


def on_engine_loop(engine, fn):
    """`fn()` run on the HTTP engine's own loop, where its router state changes."""

    async def call():
        return fn()

    return engine._call(call(), "the kill test's look at the router", 10.0)


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
            engine = actor.engine
            session = f"{task.id}/{sample_index}/{seed}"  # agent_loop.run_episode's session id

            def pin():  # the run's servers are in the order of their actors' names
                engine._sessions[session] = engine.servers[0]

            def failed():
                return engine.counters["retries"] + engine.counters["failed_requests"]

            await asyncio.to_thread(on_engine_loop, engine, pin)
            before = await asyncio.to_thread(on_engine_loop, engine, failed)
            if os.environ.get("TILLER_TEST_KILL_HOW") == "process":
                os.kill(pid, signal.SIGKILL)
            else:
                ray.kill(server, no_restart=True)
            assert await asyncio.to_thread(gone, pid, GONE_TIMEOUT_S), (
                f"engine server 0 (pid {pid}) still runs {GONE_TIMEOUT_S:g}s after its kill")
            traj = await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                        sample_index=sample_index)
            after = await asyncio.to_thread(on_engine_loop, engine, failed)
            assert after > before, f"no request of this worker failed on server 0 ({session})"
            return traj
    return await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                sample_index=sample_index)
