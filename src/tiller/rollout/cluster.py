"""The Ray cluster of `cluster.backend: ray`: connected to `cluster.address`, or a local instance
started for the run (no dashboard, a small object store, its logs copied into the run folder)
and stopped with it. Every bad input says so in one line before any work."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tiller.config import Config
from tiller.config.root import gloo_only
from tiller.errors import ConfigError, RunError
from tiller.rollout import ray_reaper
from tiller.rollout.ray_reaper import INSTANCE_ENV, REAP_TIMEOUT_S

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # an address that does not accept a TCP connection by then is refused
# connecting to cluster.address and reading its free resources, a child Python's start and
# Ray's import included (seconds on a loaded machine); and the run's own connection after it
ADDRESS_TIMEOUT_S = 60.0
# the end of the run's connecting thread once told to stop (`connect`): it ends when Ray's
# attempt returns to Python, about 35 s against an address that never answers (5 s for the GCS,
# 5 for its pubsub, then the cluster ID's wait; measured on a loaded 2-core machine)
STOP_TIMEOUT_S = 60.0


def rank_threads(cfg: Config) -> int:
    """The torch threads of each trainer rank's Ray actor, and the CPUs it reserves:
    runtime.threads, or 1 where it is auto (rank 0, the run's process, runs auto's choice)."""
    threads = cfg.runtime.threads
    return 1 if threads == "auto" else int(threads)


def ray_cpus_needed(cfg: Config) -> int:
    """The CPUs the run's Ray actors reserve: one per rollout worker (its engine or its HTTP
    client, agent loops and envs), `rank_threads` per trainer rank beyond rank 0 (which is the
    run's own process), and `server_threads` per managed engine server."""
    servers = cfg.managed_servers * int(cfg.server_threads) if cfg.managed_servers else 0
    return (cfg.cluster.rollout_workers + (cfg.train.world_size - 1) * rank_threads(cfg)
            + servers)


def check_cluster(cfg: Config) -> None:
    """Before any work: trainer ranks on CPU (gloo), a CPU for every trainer rank (local); Ray
    installed, and CPUs for every actor and a GPU for every vLLM server on CUDA: at an address
    that answers, its free CPUs and GPUs (a short connection, `check_address`); else the local
    instance's."""
    c = cfg.cluster
    if cfg.train.world_size > 1 and cfg.model.device == "auto":
        import torch

        if torch.cuda.is_available():
            raise ConfigError(gloo_only(cfg.train.world_size, "auto (cuda here)"))
    if c.backend != "ray":
        cpus = os.cpu_count() or 1
        if cfg.train.world_size > cpus:  # each rank a process with at least one core
            raise ConfigError(f"config field train.world_size: got {cfg.train.world_size}; "
                              f"this machine has {cpus} CPUs (os.cpu_count()), one per rank")
        return
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("cluster.backend=ray needs Ray: pip install -c constraints.txt "
                          "'tiller[ray]' (ray 2.60)")
    if c.address is not None:
        check_address(cfg)
        return
    cpus = c.num_cpus or os.cpu_count() or 1
    if ray_cpus_needed(cfg) > cpus:
        raise ConfigError(_too_many(cfg, cpus, "cluster.num_cpus"))
    if cfg.server_gpus:
        import torch

        check_gpus(cfg, torch.cuda.device_count(), "torch.cuda.device_count() here, which the "
                   "local Ray instance also finds")


def check_gpus(cfg: Config, gpus: float, where: str) -> None:
    """The GPUs of every vLLM server (`Config.server_gpus` each) are among the cluster's
    `gpus`."""
    need = cfg.managed_servers * cfg.server_gpus
    if need > gpus:
        raise ConfigError(f"config field engine.gpus: {cfg.managed_servers} vLLM server(s) "
                          f"of {cfg.server_gpus} GPU(s) need {need} GPU(s) under "
                          f"cluster.backend=ray; the Ray cluster has {gpus:g} ({where})")


def check_address(cfg: Config) -> None:
    """The cluster at `cluster.address` answers and has a free CPU for every actor
    (`available_resources`: what other jobs leave): `probe_address`."""
    free = probe_address(cfg.cluster.address)
    cpus = free.get("CPU", 0.0)
    if ray_cpus_needed(cfg) > cpus:
        raise ConfigError(_too_many(cfg, cpus, f"free at {cfg.cluster.address}"))
    if cfg.server_gpus:
        check_gpus(cfg, free.get("GPU", 0.0), f"free at {cfg.cluster.address}")


# A child Python connects and prints the cluster's free resources: Ray retries a GCS that
# does not answer for many minutes and acts on signals only between its retries, so the wait
# is bounded, and Ctrl-C / SIGTERM acted on, by the run's process that waits for the child.
PROBE = """
import json, sys
import ray
try:
    ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    answer = {"free": ray.available_resources()}
except (ConnectionError, RuntimeError) as e:
    causes = [e]
    while causes[-1].__cause__ is not None:
        causes.append(causes[-1].__cause__)
    answer = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              # Ray's error names it in the text of a cause (a traceback as a message)
              "auth": any("AuthenticationError" in f"{type(c).__name__}: {c}" for c in causes)}
finally:
    ray.shutdown()
print("tiller-probe " + json.dumps(answer))
"""


def probe_address(address: str) -> dict[str, float]:
    """The free resources of the Ray cluster at `address`, read by a child Python
    (`PROBE`) within ADDRESS_TIMEOUT_S; first a TCP connection to the address Ray dials
    (it replaces 127.0.0.1 and localhost by this node's IP). Else a one-line ConfigError
    naming the address."""
    from ray._private.services import canonicalize_bootstrap_address

    dial = canonicalize_bootstrap_address(address)
    host, _, port = dial.rpartition(":")
    where = f"{address!r}" + (f" (Ray dials {dial})" if dial != address else "")
    try:
        socket.create_connection((host.strip("[]"), int(port)),
                                 timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(f"config field cluster.address: got {where}; no Ray cluster answers "
                          f"there ({type(e).__name__}: {e}); start one with `ray start --head` "
                          f"or leave cluster.address unset") from e
    proc = subprocess.Popen([sys.executable, "-c", PROBE, address], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=ADDRESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out = None
    finally:  # on the timeout, Ctrl-C, SIGTERM: the child and anything it started
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if out is None:
        raise ConfigError(f"config field cluster.address: got {where}; something accepts TCP "
                          f"there but no Ray cluster answered within {ADDRESS_TIMEOUT_S:g} s "
                          f"(give the GCS address `ray start --head` prints)")
    lines = [line for line in out.splitlines() if line.startswith("tiller-probe ")]
    if not lines:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit code {proc.returncode}"
        raise ConfigError(f"config field cluster.address: got {where}; the probe of it "
                          f"failed ({last})")
    answer = json.loads(lines[-1].removeprefix("tiller-probe "))
    if answer.get("auth"):
        raise ConfigError(f"config field cluster.address: got {where}; the cluster refused "
                          f"this machine's token ({answer['error']}): with token "
                          f"authentication (Ray's default for `ray start`) set "
                          f"RAY_AUTH_MODE=token and give the cluster's token "
                          f"(~/.ray/auth_token of its head node; RAY_AUTH_TOKEN or "
                          f"RAY_AUTH_TOKEN_PATH)")
    if "error" in answer:
        raise ConfigError(f"config field cluster.address: got {where}; Ray could not connect "
                          f"({answer['error']})")
    return answer["free"]


class Stopped(BaseException):
    """Raised inside the thread of `connect` to end its `ray.init` (Python's asynchronous
    exception, `PyThreadState_SetAsyncExc`, delivered at the thread's next Python line): a
    BaseException, so Ray's retry loop, which takes an Exception for a failed try, lets it
    through."""


def connect(address: str) -> None:
    """The run's own connection to the cluster at `address` (`ray.init`), within
    ADDRESS_TIMEOUT_S.
    Ray retries a GCS that does not answer for minutes and acts on signals only between its
    retries (`PROBE`), so `ray.init` runs in a thread this process waits for. At the limit,
    or on Ctrl-C or SIGTERM, the thread is told to stop (`Stopped`): it connects nothing after
    that, and a connection it made as it was told is undone. At the limit its end is awaited
    (a cluster that stopped answering since its probe fails the run in one line naming the
    address, and no thread is left); Ctrl-C and SIGTERM are acted on at once, the thread
    ending by itself when Ray's attempt in progress returns to Python."""
    import ray

    lock = threading.Lock()
    outcome: list[BaseException | None] = []  # the thread's: None (connected) or its error

    def init() -> None:
        try:
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
                result = None
            except BaseException as e:  # raised in the run's thread below
                result = e
            with lock:
                outcome.append(result)
        except Stopped:  # told as ray.init returned: the connection it made
            ray.shutdown()

    thread = threading.Thread(target=init, name="tiller-ray-connect", daemon=True)
    thread.start()
    try:
        thread.join(ADDRESS_TIMEOUT_S)
    finally:  # the limit, Ctrl-C, SIGTERM
        with lock:
            told = not outcome
            if told:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                           ctypes.py_object(Stopped))
    if told:
        thread.join(STOP_TIMEOUT_S)
        left = ""
        if thread.is_alive():
            log.error("ray: the thread connecting to cluster.address %r did not end within "
                      "%gs of being told to stop; it is left running", address, STOP_TIMEOUT_S)
            left = (f"; its connecting thread did not end within {STOP_TIMEOUT_S:g} s of "
                    f"being told to stop and is left running")
        else:
            ray.shutdown()  # what ray.init had set up when it was stopped
        raise RunError(f"ray: the run's connection to the cluster at cluster.address "
                       f"{address!r} did not finish within {ADDRESS_TIMEOUT_S:g} s (it "
                       f"answered the probe before the run started){left}")
    if outcome[0] is not None:
        raise outcome[0]


def _too_many(cfg: Config, cpus: float, knob: str) -> str:
    servers = (f" and {cfg.managed_servers} engine server(s) of {cfg.server_threads} "
               f"thread(s)" if cfg.managed_servers else "")
    threads = f" of {rank_threads(cfg)} thread(s)" if rank_threads(cfg) > 1 else ""
    return (f"config field cluster.rollout_workers: {cfg.cluster.rollout_workers} rollout "
            f"workers{',' if servers else ' and'} {cfg.train.world_size - 1} trainer rank(s) "
            f"beyond rank 0{threads}{servers} need {ray_cpus_needed(cfg)} CPUs; the Ray cluster "
            f"has {cpus:g} ({knob})")


class RayCluster:
    """The run's Ray session: `start` connects or starts, `close` disconnects or stops. A local
    instance is guarded by `ray_reaper` (started first, told to act by `close` or by the run's
    process's death): nothing of it outlives the run, even a SIGKILLed one."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.temp_dir: str | None = None
        self.reaper: subprocess.Popen | None = None

    def start(self) -> RayCluster:
        """Connect, or start the local instance (and its guard); a start that fails stops
        what it started."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> RayCluster:
        import ray

        c = self.cfg.cluster
        t0 = time.perf_counter()
        if c.address is not None:
            connect(c.address)  # its CPUs checked before any work
        else:
            # a short folder: Ray's sockets live below it (a run folder's path may be too long)
            self.temp_dir = tempfile.mkdtemp(prefix="tiller-ray-")
            # its own session: a Ctrl-C to the run's terminal does not reach it
            self.reaper = subprocess.Popen(
                [sys.executable, "-I", ray_reaper.__file__, self.temp_dir,
                 str(self.run_dir / "ray_reaper.log")], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            os.environ[INSTANCE_ENV] = self.temp_dir  # inherited by every process of it
            try:
                ray.init(num_cpus=c.num_cpus or os.cpu_count(), include_dashboard=False,
                         object_store_memory=c.object_store_mb * 2**20,
                         _temp_dir=self.temp_dir, log_to_driver=False, configure_logging=False)
            finally:
                del os.environ[INSTANCE_ENV]
        log.info("ray: %s in %.1fs (%s)", "connected" if c.address else "started",
                 time.perf_counter() - t0, ray.cluster_resources())
        return self

    def close(self) -> None:
        """Disconnect (an address) or stop the local instance, its logs copied to
        <run>/ray_logs first."""
        import ray

        try:
            ray.shutdown()
        finally:
            try:
                if self.temp_dir is not None:
                    logs = Path(self.temp_dir) / "session_latest" / "logs"
                    if logs.is_dir():
                        shutil.copytree(logs, self.run_dir / "ray_logs", dirs_exist_ok=True,
                                        ignore_dangling_symlinks=True, symlinks=False)
                    shutil.rmtree(self.temp_dir, ignore_errors=True)
            finally:
                if self.reaper is not None:
                    self._reap()

    def _reap(self) -> None:
        """Tell the guard the run is done with the instance and wait for it: a process of the
        instance that `ray.shutdown` left is killed, logged and counted (`ray_reaper.log`)."""
        reaper, self.reaper = self.reaper, None
        assert reaper is not None and reaper.stdin is not None
        reaper.stdin.close()
        try:
            code = reaper.wait(timeout=REAP_TIMEOUT_S + 10)
        except subprocess.TimeoutExpired as e:
            reaper.kill()
            raise RunError(f"ray: the local instance's guard did not finish within "
                           f"{REAP_TIMEOUT_S + 10:g}s") from e
        if code:
            log.warning("ray: processes of the local instance outlived ray.shutdown and were "
                        "killed: %s", self.run_dir / "ray_reaper.log")
