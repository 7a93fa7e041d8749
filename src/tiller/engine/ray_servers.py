"""Managed engine servers placed by Ray (`cluster.backend: ray` with engine.backend http and
engine.servers, or vllm): one Ray actor per server, each owning its server process through
`ManagedServers` (its own process group, its log in <run>/servers), placed with a placement
group of one bundle per server whose CPUs are the server's threads (and one GPU for a vLLM
server on CUDA).

The servers bind loopback, so every bundle is pinned to the run's node (Ray's `node:<ip>`
resource): the run's engine pushes weights to them and reads their answers there, and the
rollout workers are pinned there too (`rollout/ray_http.py`). A server's whole process group
gets SIGKILL when its actor's process dies, however it dies (`ManagedServers`' watch process,
which is not one of the actor's children, which Ray kills with it). `close` stops each server
through its actor (SIGTERM to its group, a grace period, SIGKILL), then kills the actors and
removes the group."""

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
ACTOR_START_S = 60.0  # an actor's own start (imports), on top of engine.startup_timeout_s
NODE_SHARE = 0.001  # of the node's `node:<ip>` resource (1.0): pins a bundle, takes nothing


class ServerActor:
    """One managed server in a Ray actor: started by `start`, stopped by `close` or with the
    actor's process."""

    def __init__(self, spec: ServerSpec, log_dir: Path, startup_timeout_s: float):
        self.servers = ManagedServers([spec], log_dir=log_dir,
                                      startup_timeout_s=startup_timeout_s)

    def start(self) -> str:
        """Its URL once healthy (`ManagedServers.start`'s errors, one line, otherwise)."""
        return self.servers.start()[0]

    def pid(self) -> int:
        """The server process's id (its process group's)."""
        return self.servers.running[0].proc.pid

    def exited(self, wait_s: float = 0.0) -> list[str]:
        """`ManagedServers.exited` of its server."""
        return self.servers.exited(wait_s)

    def close(self) -> None:
        self.servers.close()


def node_pin() -> dict[str, float]:
    """The bundle resource that places an actor on this process's node."""
    import ray

    return {f"node:{ray.util.get_node_ip_address()}": NODE_SHARE}


def place_group(bundles: list[dict[str, float]], what: str, timeout_s: float) -> Any:
    """A placement group of `bundles` (PACK: on as few nodes as fit) named `tiller-<what>-<tag>`
    once Ray placed it, within `timeout_s`. Not placed by then (or the wait interrupted): the
    group is removed, and a RunError names it, what it asked for and what the cluster has
    free."""
    import ray
    from ray.util.placement_group import placement_group

    name = f"tiller-{what.replace(' ', '-')}-{uuid.uuid4().hex[:8]}"
    group = placement_group(bundles, strategy="PACK", name=name)
    try:
        ray.get(group.ready(), timeout=max(0.0, timeout_s))
    except ray.exceptions.GetTimeoutError as e:
        ray.util.remove_placement_group(group)
        asked = ", ".join(f"{n} x {_resources(b)}" for b, n in _counted(bundles))
        free = _resources(ray.available_resources())
        raise RunError(f"ray: placement group {name} ({asked}) was not placed within "
                       f"{timeout_s:g}s; the cluster has {free} free") from e
    except BaseException:
        ray.util.remove_placement_group(group)
        raise
    return group


def _counted(bundles: list[dict[str, float]]) -> list[tuple[dict[str, float], int]]:
    """Each distinct bundle and how many times it is asked for, in order."""
    out: list[tuple[dict[str, float], int]] = []
    for b in bundles:
        if out and out[-1][0] == b:
            out[-1] = (b, out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def _resources(res: dict[str, float]) -> str:
    """`{'CPU': 1, 'node:10.0.0.2': 0.001}` for a line (memory and object store left out)."""
    shown = {k: v for k, v in res.items() if k not in ("memory", "object_store_memory")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


def finished(refs: list[Any], timeout_s: float) -> set[Any]:
    """Those of the Ray object refs `refs` that are ready (a value or an error) within one
    deadline of `timeout_s` over them all: N hung actors cost one timeout, not N."""
    import ray

    if not refs:
        return set()
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
    return set(done)


def first_line(e: BaseException) -> str:
    """`Type: first line of the message` of `e` (Ray's errors span many lines)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def actor_cause(e: BaseException) -> str:
    """One line for a dead actor: the error its constructor raised (the last line of Ray's
    traceback, `Type: message`), else `first_line`."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if getattr(e, "actor_init_failed", False) and lines:
        return f"{type(e).__name__}: its constructor raised {lines[-1]}"
    return first_line(e)


class RayServers:
    """The servers of `specs`, each in a `ServerActor` on a bundle of `cpus` CPUs (and `gpus`
    GPUs) of one placement group on the run's node: a `servers.Launcher` (`start`, `logs`,
    `close`)."""

    def __init__(self, specs: list[ServerSpec], *, log_dir: str | Path,
                 startup_timeout_s: float, cpus: int, gpus: int = 0):
        self.specs, self.log_dir = list(specs), Path(log_dir)
        self.startup_timeout_s, self.cpus, self.gpus = startup_timeout_s, cpus, gpus
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.group: Any = None

    def start(self) -> list[str]:
        """Place the group (within engine.startup_timeout_s), start every server in what is
        left of it (the actor's own start, `ACTOR_START_S`, on top); their URLs once all are
        healthy. On any failure (an actor not created, a server exits or times out, the group
        is not placed, Ctrl-C) every actor made so far and the group are removed first, then
        one RunError names what failed."""
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            self._place(deadline)
            self._start_all(deadline + ACTOR_START_S)
        except BaseException:
            self.close()
            raise
        return self.urls

    def _place(self, deadline: float) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = len(self.specs)
        bundle = {"CPU": float(self.cpus), **({"GPU": float(self.gpus)} if self.gpus else {}),
                  **node_pin()}
        self.group = place_group([bundle] * n, f"{n} engine servers", self.startup_timeout_s)
        remote = ray.remote(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0)(ServerActor)
        run = uuid.uuid4().hex[:8]  # names are unique on a cluster that other runs share
        for i, spec in enumerate(self.specs):
            try:
                self.actors.append(remote.options(
                    name=f"{ACTOR_PREFIX}{spec.name}-{run}",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.group, placement_group_bundle_index=i)).remote(
                    spec, self.log_dir, max(1.0, deadline - time.monotonic())))
            except Exception as e:  # e.g. the name is taken
                raise RunError(f"ray: engine server {spec.name}'s actor was not created "
                               f"({first_line(e)})") from e

    def _start_all(self, deadline: float) -> None:
        import ray

        refs = [a.start.remote() for a in self.actors]
        wait = self.startup_timeout_s + ACTOR_START_S
        for spec, ref in zip(self.specs, refs, strict=True):
            try:
                self.urls.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.RayTaskError as e:  # its RunError: the server's one line
                raise RunError(str(e.cause) if e.cause is not None else first_line(e)) from e
            except ray.exceptions.GetTimeoutError as e:
                raise RunError(f"ray: engine server {spec.name}'s actor did not start it within "
                               f"{wait:g}s (placement included); log "
                               f"{self.log_dir / spec.name}.log") from e
            except ray.exceptions.RayActorError as e:
                raise RunError(f"ray: engine server {spec.name}'s actor died during start-up "
                               f"({actor_cause(e)})") from e

    def logs(self) -> dict[str, Path]:
        return {url: self.log_dir / f"{spec.name}.log"
                for url, spec in zip(self.urls, self.specs, strict=False)}

    def exited(self, wait_s: float = 0.0) -> list[str]:
        """One line per server that has exited or whose actor died (it took its server with
        it) or did not answer within `EXITED_TIMEOUT_S` past `wait_s` (one deadline over all
        the actors; `ManagedServers.exited`'s `wait_s` in each): its name, URL and log."""
        import ray

        refs = [a.exited.remote(wait_s) for a in self.actors]
        done = finished(refs, EXITED_TIMEOUT_S + wait_s)
        lines = []
        for spec, url, ref in zip(self.specs, self.urls, refs, strict=False):
            log_file = self.log_dir / f"{spec.name}.log"
            if ref not in done:
                lines.append(f"server {spec.name} ({url}): its Ray actor did not answer within "
                             f"{EXITED_TIMEOUT_S:g} s; log {log_file}")
                continue
            try:
                lines += ray.get(ref, timeout=0)
            except ray.exceptions.RayActorError:
                lines.append(f"server {spec.name} ({url}): its Ray actor died, and the server "
                             f"with it; log {log_file}: {last_line(log_file)}")
        return lines

    def close(self) -> None:
        """Stop each server through its actor (a dead actor took its server with it; those
        that do not answer within `CLOSE_TIMEOUT_S`, one deadline over all, are logged, and
        their servers die with them when they are killed: the watch), then kill the actors
        and remove the group. Idempotent."""
        import ray

        actors, self.actors = self.actors, []
        try:
            refs = [a.close.remote() for a in actors]
            done = finished(refs, CLOSE_TIMEOUT_S)
            for spec, ref in zip(self.specs, refs, strict=False):
                if ref not in done:
                    log.error("ray: engine server %s's actor did not stop it within %gs; the "
                              "actor is killed, and its server with it", spec.name,
                              CLOSE_TIMEOUT_S)
                    continue
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayTaskError as e:  # the others are still stopped
                    log.error("ray: engine server %s's actor failed to stop it: %s", spec.name,
                              e.cause if e.cause is not None else e)
                except ray.exceptions.RayActorError:
                    log.warning("ray: engine server %s's actor had died; its server with it",
                                spec.name)
        finally:
            for a in actors:
                ray.kill(a)
            if self.group is not None:
                ray.util.remove_placement_group(self.group)
                self.group = None
