"""Where the trainer's other ranks run: spawned processes (`cluster.backend: local`) or Ray
actors (`ray`), each a `Follower` that runs rank 0's steps on its shard (`train.distributed`).
`start_ranks` starts them and joins the process group; `Leader.close` stops them."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tiller.config import LoRAConfig
from tiller.errors import RunError
from tiller.train.distributed import (
    STOP_TIMEOUT_S,
    Leader,
    LoraLeader,
    Rank,
    TrainerOptions,
    rank_trainer,
)
from tiller.train.lora import Lora

log = logging.getLogger(__name__)

JOIN_POLL_S = 0.2  # how often rank 0 checks, during start, that the other ranks still live
EXIT_AFTER_ERROR_S = 1.0  # a rank whose step raised exits this long after answering
LOOPBACK = "lo"  # Linux's loopback interface: on one node the ranks' gloo pairs bind its 127.0.0.1
LOOPBACK_GLOO = "tiller_gloo_lo"  # gloo with its device there, registered as a backend
# the rendezvous folder of one node's ranks, in the temporary folder: + rank 0's pid + "-" + a
# random part (`tempfile.mkdtemp`)
RENDEZVOUS_PREFIX = "tiller-ranks-"
RENDEZVOUS_LOCK = "lock"  # in it: flock'd by its rank 0 for as long as that runs
# rendezvous folders of rank 0s that no longer ran, removed at ranks' starts in this process
STALE_RENDEZVOUS: Counter[str] = Counter()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def joined_key(rank: int) -> str:
    return f"tiller/joined/{rank}"


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet and how their gloo pairs connect. On one node (`folder`: a private
    temporary folder of rank 0's): a `FileStore` in it, which listens on no port, and gloo on
    the loopback interface (`LOOPBACK`), so no rank listens beyond 127.0.0.1. Else (a cluster at
    cluster.address: ranks on other nodes) rank 0's `TCPStore` at `host`:`port`, and gloo on the
    interface of each rank's hostname."""

    folder: str | None = None
    host: str = ""
    port: int = 0

    def store(self, world: int, is_master: bool, timeout: timedelta) -> dist.Store:
        if self.folder is None:
            return dist.TCPStore(self.host, self.port, world, is_master=is_master,
                                 wait_for_workers=False, timeout=timeout)
        store = dist.FileStore(os.path.join(self.folder, "store"), world)
        store.set_timeout(timeout)
        return store

    def join(self, store: dist.Store, rank: int, world: int, timeout: timedelta) -> None:
        """`init_process_group` of `rank`: gloo, on one node with its device on the loopback
        interface (`LOOPBACK_GLOO`: given to gloo directly, no process-wide environment
        variable written while this process's other threads run)."""
        backend = "gloo"
        if self.folder is not None:
            backend = LOOPBACK_GLOO
            if not hasattr(dist.Backend, LOOPBACK_GLOO.upper()):  # once per process
                dist.Backend.register_backend(LOOPBACK_GLOO, _loopback_gloo, devices=["cpu"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)


def _loopback_gloo(store: dist.Store, rank: int, size: int, timeout: timedelta
                   ) -> dist.ProcessGroupGloo:
    """A gloo process group whose one device is on the loopback interface: its pairs bind
    127.0.0.1 (what GLOO_SOCKET_IFNAME=lo would do)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=LOOPBACK)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


class Follower:
    """Rank `rank` (> 0): joins the process group and runs each step rank 0 sends."""

    def __init__(self, rank: int, world: int, meet: Rendezvous, model: nn.Module,
                 options: TrainerOptions, threads: int, timeout_s: float,
                 lora: LoRAConfig | None = None):
        """`model`: the full model, or under `lora` the base model (`train.distributed.
        rank_trainer`)."""
        torch.set_num_threads(threads)
        timeout = timedelta(seconds=timeout_s)
        store = meet.store(world, False, timeout)
        store.set(joined_key(rank), "1")  # rank 0 waits for this, watching that this rank lives
        meet.join(store, rank, world, timeout)
        self.trainer = rank_trainer(model, lora, rank, world, options)

    def run(self, name: str, args: tuple, lrs: list[float]) -> None:
        try:
            self.trainer.run(name, args, lrs)
        except BaseException:
            # the other ranks may be waiting in a collective this rank will not join: this
            # process exits once its error is answered, and its closed connections end their
            # wait now, not at train.rank_timeout_s (leaving the process group does not)
            threading.Timer(EXIT_AFTER_ERROR_S, os._exit, args=(1,)).start()
            raise

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _follow(conn: Connection, *args: Any) -> None:
    """A spawned rank's main: steps from `conn` until rank 0 says stop (None) or is gone."""
    follower = Follower(*args)
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # rank 0 is gone: nothing left to follow
                break
            if msg is None:
                break
            try:
                follower.run(*msg)
            except Exception as e:
                conn.send(f"{type(e).__name__}: {e}")
                raise
            conn.send(None)
    finally:
        follower.close()


class ProcessRank:
    """A rank in a spawned process, its steps over a pipe."""

    def __init__(self, rank: int, args: tuple):
        self.rank, self.name = rank, ""
        self.answer: str | None | bool = False  # the last call's: False (none yet), None (ok)
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_follow, args=(theirs, rank, *args), daemon=True,
                                name=f"tiller-trainer-rank{rank}")
        self.proc.start()
        theirs.close()

    def send(self, name: str, args: tuple, lrs: list[float]) -> None:
        self.name, self.answer = name, False
        try:
            self.conn.send((name, args, lrs))
        except (BrokenPipeError, ConnectionResetError) as e:
            raise RunError(f"trainer rank {self.rank} {self.ended()} before {name}") from e

    def _answered(self, timeout_s: float) -> bool:
        """Whether the last call answered within `timeout_s` (kept in `answer`)."""
        if self.answer is False and self.conn.poll(timeout_s):
            try:
                self.answer = self.conn.recv()
            except EOFError:  # the pipe closed: the rank is gone
                return False
        return self.answer is not False

    def wait(self, timeout_s: float) -> None:
        if not self._answered(timeout_s):
            how = self.ended()
            raise RunError(f"trainer rank {self.rank} {how} during {self.name}" if how
                           else f"trainer rank {self.rank} did not finish {self.name} within "
                           f"train.rank_timeout_s={timeout_s}")
        if self.answer is not None:
            raise RunError(f"trainer rank {self.rank} failed ({self.answer}) during "
                           f"{self.name}")

    def ended(self) -> str | None:
        if self._answered(0.5) and self.answer is not None:
            return f"failed ({self.answer})"
        self.proc.join(0.5)  # a rank whose pipe just closed is exiting
        return None if self.proc.is_alive() else f"died (exit code {self.proc.exitcode})"

    def died_starting(self) -> str | None:
        return None if self.proc.is_alive() else f"exit code {self.proc.exitcode}"

    def answered(self) -> bool:
        return not self.name or self._answered(0) or not self.proc.is_alive()

    def stop(self, deadline: float) -> None:
        if self.proc.is_alive() and self.answered():
            try:
                self.conn.send(None)
            except (BrokenPipeError, ConnectionResetError):
                log.warning("trainer rank %d: its pipe closed before stop", self.rank)
            self.proc.join(max(0.0, deadline - time.monotonic()))
            if self.proc.is_alive():
                log.error("trainer rank %d did not stop within close's %.0f s: killed",
                          self.rank, STOP_TIMEOUT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(STOP_TIMEOUT_S)
        self.conn.close()


class RayRank:
    """Rank `rank` in a Ray actor; its steps are actor calls."""

    def __init__(self, rank: int, args: tuple, cpus: int):
        import ray

        self._ray, self.rank, self.name = ray, rank, ""
        self.actor = ray.remote(num_cpus=cpus, max_restarts=0)(Follower).remote(rank, *args)
        self.ready = self.actor.__ray_ready__.remote()  # ends when __init__ ends (or fails)
        self.pending: Any = None

    def send(self, name: str, args: tuple, lrs: list[float]) -> None:
        self.name = name
        self.pending = self.actor.run.remote(name, args, lrs)

    def wait(self, timeout_s: float) -> None:
        ray = self._ray
        try:
            ray.get(self.pending, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise RunError(f"trainer rank {self.rank} did not finish {self.name} within "
                           f"train.rank_timeout_s={timeout_s}") from e
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            raise RunError(f"trainer rank {self.rank} {self._how(e)} during "
                           f"{self.name}") from e

    def _how(self, e: Exception) -> str:
        if isinstance(e, self._ray.exceptions.RayActorError):
            return f"died (Ray actor: {type(e).__name__})"
        cause = getattr(e, "cause", None) or e
        return f"failed ({type(cause).__name__}: {cause})"

    def ended(self) -> str | None:
        ray = self._ray
        if self.pending is None:
            return None
        try:
            ray.get(self.pending, timeout=0.5)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            return self._how(e)
        except ray.exceptions.GetTimeoutError:
            return None
        return None

    def died_starting(self) -> str | None:
        ray = self._ray
        done, _ = ray.wait([self.ready], timeout=0)
        if not done:
            return None
        try:
            ray.get(self.ready, timeout=0)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            return f"Ray actor: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None

    def answered(self) -> bool:
        return self.pending is None or bool(self._ray.wait([self.pending], timeout=0)[0])

    def stop(self, deadline: float) -> None:
        ray = self._ray
        if self.answered():
            try:
                ray.get(self.actor.close.remote(),
                        timeout=max(0.0, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                    ray.exceptions.RayTaskError) as e:
                log.warning("trainer rank %d did not close cleanly (%s); killed", self.rank,
                            type(e).__name__)
        ray.kill(self.actor)


class RendezvousFolder:
    """Rank 0's private rendezvous folder, `tiller-ranks-<pid>-<random>` in `parent` (default
    the temporary folder; mode 0700), whose file `RENDEZVOUS_LOCK` this process holds an
    exclusive `flock` on until `remove`: the kernel drops the lock when the process ends, however
    it ends, so `remove_stale_rendezvous` knows a live run's folder by its lock, whatever PID
    namespace the run is in. The lock file is made under another name, locked, then renamed:
    under its name it is never unlocked while its rank 0 runs."""

    def __init__(self, parent: Path | None = None):
        self.path = tempfile.mkdtemp(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}-", dir=parent)
        try:
            new = os.path.join(self.path, f".{RENDEZVOUS_LOCK}-new")
            self.fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(new, os.path.join(self.path, RENDEZVOUS_LOCK))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """The folder removed, then the lock given up."""
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(self.fd)


def remove_stale_rendezvous(folder: Path | None = None) -> list[str]:
    """Remove this user's rendezvous folders `tiller-ranks-*` of `folder` (default the
    temporary folder) whose rank 0 no longer runs (a rank 0 killed by SIGKILL or the OOM killer
    cannot remove its own: `Leading.close` does): those whose lock file (`RendezvousFolder`)
    this process can lock now, without waiting; it holds the lock while it removes the folder.
    Return their names. Folders whose lock is held (a live run's, in any PID namespace), without
    a lock file (one being made, or a tiller's from before the lock), of other users, links and
    files are left; one that cannot be removed is left with a warning."""
    removed = []
    for p in sorted(Path(folder or tempfile.gettempdir()).glob(f"{RENDEZVOUS_PREFIX}*")):
        try:
            st = p.lstat()
        except FileNotFoundError:  # removed meanwhile
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        try:
            fd = os.open(p / RENDEZVOUS_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # no lock file (or a link, or removed meanwhile): left
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: its rank 0 runs
                continue
            try:
                shutil.rmtree(p)
            except FileNotFoundError:  # another start removed it meanwhile
                continue
            except OSError as e:  # left, said: the next start tries again
                log.warning("could not remove the stale rendezvous folder %s: %s: %s", p,
                            type(e).__name__, e)
                continue
            removed.append(p.name)
        finally:
            os.close(fd)
    return removed


def await_joined(store: dist.Store, ranks: list[Rank], timeout_s: float) -> None:
    """Until every other rank has reached the process group (its key in `store`): a rank that
    dies before fails the start at once, naming it, not after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        for r in ranks:
            if (how := r.died_starting()) is not None:
                raise RunError(f"trainer rank {r.rank} died during start: {how}")
        waiting = [r.rank for r in ranks if not store.check([joined_key(r.rank)])]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise RunError(f"trainer rank(s) {waiting} did not join the process group within "
                           f"train.rank_timeout_s={timeout_s:g}")
        time.sleep(JOIN_POLL_S)


def start_ranks(full: nn.Module, world: int, options: TrainerOptions, backend: str,
                timeout_s: float, remote: bool = False, lora: Lora | None = None,
                actor_threads: int = 1) -> Leader | LoraLeader:
    """Rank 0 (this process) and `world - 1` other ranks (`backend` local: spawned
    processes at this process's torch threads; ray: Ray actors on the connected cluster, each
    reserving `actor_threads` CPUs and running as many torch threads), in one gloo process
    group. On one
    node they meet in a file of a private temporary folder (removed by `Leader.close`) and
    their gloo pairs bind 127.0.0.1 (`Rendezvous`); with `remote` (a Ray cluster at
    `cluster.address`, whose actors may be on other nodes) at a TCP store on this node's IP.
    Under model.lora (`lora`: rank 0's, around `full`) the other ranks get the base model and
    build their own (`train.distributed.LoraRankTrainer`)."""
    if dist.is_initialized():
        raise RunError("train.world_size > 1: this process already has a torch.distributed "
                       "process group (another run's trainer ranks, still open)")
    held: RendezvousFolder | None = None
    if remote:
        import ray

        meet = Rendezvous(host=ray.util.get_node_ip_address(), port=free_port())
    else:
        stale = remove_stale_rendezvous()
        if stale:
            STALE_RENDEZVOUS["removed"] += len(stale)
            log.warning("removed %d trainer-rank rendezvous folder(s) of runs that no longer "
                        "run from %s: %s", len(stale), tempfile.gettempdir(), ", ".join(stale))
        held = RendezvousFolder()
        meet = Rendezvous(folder=held.path)
    timeout = timedelta(seconds=timeout_s)
    model, lora_cfg = (full, None) if lora is None else (lora.base(), lora.cfg)
    common = (world, meet, model, options)
    ranks: list[Rank] = []
    try:
        store = meet.store(world, True, timeout)
        for r in range(1, world):
            if backend == "ray":
                ranks.append(RayRank(r, (*common, actor_threads, timeout_s, lora_cfg),
                                     actor_threads))
            else:
                ranks.append(ProcessRank(r, (*common, torch.get_num_threads(), timeout_s,
                                                 lora_cfg)))
        await_joined(store, ranks, timeout_s)
        meet.join(store, 0, world, timeout)
        if lora is not None:
            return LoraLeader(lora, world, options, ranks, timeout_s, rendezvous=held)
        return Leader(full, world, options, ranks, timeout_s, rendezvous=held)
    except BaseException:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for r in ranks:
            r.stop(deadline)
        if dist.is_initialized():
            dist.destroy_process_group()
        if held is not None:
            held.remove()
        raise
