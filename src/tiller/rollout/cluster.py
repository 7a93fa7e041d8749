"""The Ray cluster of `cluster.backend: ray`: connected to `cluster.address`, or a local instance
started for the run (no dashboard, a small object store, its logs copied into the run folder)
and stopped with it. Every bad input says so in one line before any work."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiller.config import Config
from tiller.config.root import gloo_only
from tiller.errors import ConfigError, RunError
from tiller.rollout import ray_reaper
from tiller.rollout.ray_reaper import INSTANCE_ENV, REAP_TIMEOUT_S

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0  # an address that does not accept a TCP connection by then is refused


def ray_cpus_needed(cfg: Config) -> int:
    """The CPUs the run's Ray actors reserve: one per rollout worker (its engine or its HTTP
    client, agent loops and envs), one per trainer rank beyond rank 0 (which is the run's own
    process), and `server_threads` per managed engine server."""
    servers = cfg.managed_servers * int(cfg.server_threads) if cfg.managed_servers else 0
    return cfg.cluster.rollout_workers + cfg.train.world_size - 1 + servers


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
        host, _, port = c.address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as e:
            raise ConfigError(f"config field cluster.address: got {c.address!r}; no Ray cluster "
                              f"answers there ({type(e).__name__}: {e}); start one with "
                              f"`ray start --head` or leave cluster.address unset") from e
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
    """The cluster at `cluster.address` has a free CPU for every actor (`available_resources`:
    what other jobs leave); connected only for this check."""
    import ray

    try:
        ray.init(address=cfg.cluster.address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except (ConnectionError, RuntimeError) as e:  # e.g. its token authentication refused us
        raise ConfigError(f"config field cluster.address: got {cfg.cluster.address!r}; Ray "
                          f"could not connect ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); with token "
                          f"authentication, this machine needs the cluster's token "
                          f"(RAY_AUTH_TOKEN)") from e
    try:
        free = ray.available_resources()
    finally:
        ray.shutdown()
    cpus = free.get("CPU", 0.0)
    if ray_cpus_needed(cfg) > cpus:
        raise ConfigError(_too_many(cfg, cpus, f"free at {cfg.cluster.address}"))
    if cfg.server_gpus:
        check_gpus(cfg, free.get("GPU", 0.0), f"free at {cfg.cluster.address}")


def _too_many(cfg: Config, cpus: float, knob: str) -> str:
    servers = (f" and {cfg.managed_servers} engine server(s) of {cfg.server_threads} "
               f"thread(s)" if cfg.managed_servers else "")
    return (f"config field cluster.rollout_workers: {cfg.cluster.rollout_workers} rollout "
            f"workers{',' if servers else ' and'} {cfg.train.world_size - 1} trainer rank(s) "
            f"beyond rank 0{servers} need {ray_cpus_needed(cfg)} CPUs; the Ray cluster has "
            f"{cpus:g} ({knob})")


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
            ray.init(address=c.address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)  # its CPUs checked before any work
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
