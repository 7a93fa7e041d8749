"""Managed engine servers placed by Ray (`cluster.backend: ray` with engine.backend http and
engine.servers, or vllm): one Ray actor per server, each owning its server process through
`ManagedServers` (its own process group, its log in <run>/servers), placed with a placement
group of one bundle per server whose CPUs are the server's threads.

The servers bind loopback, so every bundle is pinned to the run's node (Ray's `node:<ip>`
resource): the run's engine pushes weights to them and reads their answers there, and the
rollout workers are pinned there too (`rollout/ray_http.py`). A server's whole process group
gets SIGKILL when its actor's process dies, however it dies (`ManagedServers(die_with_owner=
True)`: a watch process that is not one of the actor's children, which Ray kills with it).
`close`
stops each server through its actor (SIGTERM to its group, a grace period, SIGKILL), then kills
the actors and removes the group."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

from tiller.engine.servers import STOP_GRACE_S, ManagedServers, ServerSpec, last_line
from tiller.errors import RunError

log = logging.getLogger(__name__)

EXITED_TIMEOUT_S = 10.0  # an actor's answer to which of its servers exited
CLOSE_TIMEOUT_S = STOP_GRACE_S + 20.0  # an actor's close: SIGTERM, the grace, SIGKILL, reap
ACTOR_PREFIX = "tiller-server-"  # each actor's name: this, the server's name, the run's tag
NODE_SHARE = 0.001  # of the node's `node:<ip>` resource (1.0): pins a bundle, takes nothing


class ServerActor:
    """One managed server in a Ray actor: started by `start`, stopped by `close` or with the
    actor's process."""

    def __init__(self, spec: ServerSpec, log_dir: Path, startup_timeout_s: float):
        self.servers = ManagedServers([spec], log_dir=log_dir,
                                      startup_timeout_s=startup_timeout_s, die_with_owner=True)

    def start(self) -> str:
        """Its URL once healthy (`ManagedServers.start`'s errors, one line, otherwise)."""
        return self.servers.start()[0]

    def pid(self) -> int:
        """The server process's id (its process group's)."""
        return self.servers.running[0].proc.pid

    def exited(self) -> list[str]:
        """`ManagedServers.exited` of its server."""
        return self.servers.exited()

    def close(self) -> None:
        self.servers.close()


def node_pin() -> dict[str, float]:
    """The bundle resource that places an actor on this process's node."""
    import ray

    return {f"node:{ray.util.get_node_ip_address()}": NODE_SHARE}


class RayServers:
    """The servers of `specs`, each in a `ServerActor` on a bundle of `cpus` CPUs of one
    placement group on the run's node: a `servers.Launcher` (`start`, `logs`, `close`)."""

    def __init__(self, specs: list[ServerSpec], *, log_dir: str | Path,
                 startup_timeout_s: float, cpus: int):
        self.specs, self.log_dir = list(specs), Path(log_dir)
        self.startup_timeout_s, self.cpus = startup_timeout_s, cpus
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.group: Any = None

    def start(self) -> list[str]:
        """Place the group, start every server; their URLs once all are healthy. On any
        failure (a server exits or times out, the group is not placed, Ctrl-C) every actor and
        server is stopped first, then one RunError names the server."""
        try:
            self._place()
            self._start_all()
        except BaseException:
            self.close()
            raise
        return self.urls

    def _place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = len(self.specs)
        self.group = placement_group([{"CPU": self.cpus, **node_pin()}] * n, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=self.startup_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise RunError(f"ray: the placement group of {n} engine server(s) ({self.cpus} CPU "
                           f"each, on the run's node) was not placed within "
                           f"{self.startup_timeout_s:g}s") from e
        remote = ray.remote(num_cpus=self.cpus, max_restarts=0)(ServerActor)
        run = uuid.uuid4().hex[:8]  # names are unique on a cluster that other runs share
        self.actors = [remote.options(
            name=f"{ACTOR_PREFIX}{spec.name}-{run}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=i)).remote(
            spec, self.log_dir, self.startup_timeout_s) for i, spec in enumerate(self.specs)]

    def _start_all(self) -> None:
        import ray

        refs = [a.start.remote() for a in self.actors]
        wait = self.startup_timeout_s + 60.0  # the actor's own start (imports) comes first
        deadline = time.monotonic() + wait
        for spec, ref in zip(self.specs, refs, strict=True):
            try:
                self.urls.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.RayTaskError as e:  # its RunError: the server's one line
                raise RunError(str(e.cause) if e.cause is not None else str(e)) from e
            except ray.exceptions.GetTimeoutError as e:
                raise RunError(f"ray: engine server {spec.name}'s actor did not start it within "
                               f"{wait:g}s; log {self.log_dir / spec.name}.log") from e
            except ray.exceptions.RayActorError as e:
                raise RunError(f"ray: engine server {spec.name}'s actor died during start-up "
                               f"({type(e).__name__})") from e

    def logs(self) -> dict[str, Path]:
        return {url: self.log_dir / f"{spec.name}.log"
                for url, spec in zip(self.urls, self.specs, strict=False)}

    def exited(self) -> list[str]:
        """One line per server that has exited or whose actor died (it took its server with
        it) or did not answer within `EXITED_TIMEOUT_S`: its name, URL and log."""
        import ray

        lines = []
        for spec, url, actor in zip(self.specs, self.urls, self.actors, strict=False):
            log_file = self.log_dir / f"{spec.name}.log"
            try:
                lines += ray.get(actor.exited.remote(), timeout=EXITED_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                lines.append(f"server {spec.name} ({url}): its Ray actor died, and the server "
                             f"with it; log {log_file}: {last_line(log_file)}")
            except ray.exceptions.GetTimeoutError:
                lines.append(f"server {spec.name} ({url}): its Ray actor did not answer within "
                             f"{EXITED_TIMEOUT_S:g} s; log {log_file}")
        return lines

    def close(self) -> None:
        """Stop each server through its actor (a dead actor took its server with it; one that
        does not answer within `CLOSE_TIMEOUT_S` is logged, and its server dies with it when
        it is killed: the watch), then kill the actors and remove the group. Idempotent."""
        import ray

        actors, self.actors = self.actors, []
        try:
            refs = [a.close.remote() for a in actors]
            for spec, ref in zip(self.specs, refs, strict=False):
                try:
                    ray.get(ref, timeout=CLOSE_TIMEOUT_S)
                except ray.exceptions.RayTaskError as e:  # the others are still stopped
                    log.error("ray: engine server %s's actor failed to stop it: %s", spec.name,
                              e.cause if e.cause is not None else e)
                except ray.exceptions.RayActorError:
                    log.warning("ray: engine server %s's actor had died; its server with it",
                                spec.name)
                except ray.exceptions.GetTimeoutError:
                    log.error("ray: engine server %s's actor did not stop it within %gs; the "
                              "actor is killed, and its server with it", spec.name,
                              CLOSE_TIMEOUT_S)
        finally:
            for a in actors:
                ray.kill(a)
            if self.group is not None:
                ray.util.remove_placement_group(self.group)
                self.group = None
