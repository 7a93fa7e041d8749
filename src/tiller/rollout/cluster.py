"""The Ray cluster of `cluster.backend: ray`: connected to `cluster.address`, or a local instance
started for the run (no dashboard, a small object store, its logs copied into the run folder)
and stopped with it. Every bad input says so in one line before any work."""

from __future__ import annotations

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
from typing import Any

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


# Ray's tries at an address's GCS (`ray._private.node.Node._init_gcs_client`: 20 by default,
# each about 35 s against an address that never answers, so minutes): one while the run
# connects (`gcs_tries`), so that a thread the run gave up ends by itself. Unless the user set
# it: then theirs bounds the thread.
GCS_TRIES_ENV = "RAY_gcs_server_port_wait_time_s"
_tries_lock = threading.Lock()
_tries_users = 0  # connecting threads running under it
_tries_before: str | None = None  # the variable's value before the first of them


def gcs_tries(on: bool) -> None:
    """Ray's GCS tries set to one (`on`, by a connecting thread before its `ray.init`) or
    restored (after it returned), counted over the threads that run at once."""
    global _tries_users, _tries_before
    with _tries_lock:
        if on:
            if _tries_users == 0:
                _tries_before = os.environ.get(GCS_TRIES_ENV)
                os.environ.setdefault(GCS_TRIES_ENV, "1")
            _tries_users += 1
            return
        _tries_users -= 1
        if _tries_users == 0 and _tries_before is None:
            os.environ.pop(GCS_TRIES_ENV, None)


# the run's connecting threads that outlived the run's wait for them (`connect`): each ends by
# itself when Ray's attempt returns (about 35 s against an address that never answers, 5 s for
# the GCS, 5 for its pubsub, then the cluster ID's wait; measured on a loaded 2-core machine)
# and disconnects what it connected; counted and logged
given_up = 0
_given_up_threads: list[threading.Thread] = []  # those of them not yet seen to end
# how long a later Ray start in this process waits for them (`wait_given_up`): their one GCS
# try, with room on a loaded machine
GIVEN_UP_WAIT_S = 90.0


def wait_given_up() -> None:
    """Before this process starts or connects Ray again (`RayCluster.start`, e.g. a second
    `Trainer.train()` after a connection error): wait for the connecting threads it gave up
    to end (their `ray.shutdown()` would act on the new session; their one-try GCS setting
    would cut a local start's tries), at most GIVEN_UP_WAIT_S in all; one line if one lives on."""
    deadline = time.monotonic() + GIVEN_UP_WAIT_S
    for thread in list(_given_up_threads):
        if thread.is_alive():
            log.warning("ray: waiting for the connection this process gave up earlier (%s) "
                        "to end before Ray starts again", thread.name)
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            raise RunError(f"ray: a connection this process gave up earlier ({thread.name}) "
                           f"is still inside ray.init after {GIVEN_UP_WAIT_S:g} s more; run "
                           f"again in a new process")
        _given_up_threads.remove(thread)


class _Connecting:
    """One `ray.init(address)` in a thread, and the run that waits for it: they share a lock
    and three flags, `entered` and `done` (the thread's, with its `error` or None) and
    `gave_up` (the run's). Whichever comes second acts: the run goes on with (or, on Ctrl-C,
    undoes) a connection that is done; the thread undoes the one it makes after the run gave
    up, and one that finds the run gone before it entered (Ctrl-C inside `Thread.start()`)
    returns without a `ray.init`. Only the thread counts itself in `gcs_tries`, once each way,
    so no Ctrl-C in the run's thread can count it twice or not at all (review s10-final G3)."""

    def __init__(self, address: str):
        self.address = address
        self.lock = threading.Lock()
        self.entered, self.done, self.gave_up, self.error = False, False, False, None
        self.gave_up_at = 0.0
        self.thread = threading.Thread(target=self.init, name="tiller-ray-connect",
                                       daemon=True)

    def init(self) -> None:
        import ray

        with self.lock:
            if self.gave_up:
                return
            self.entered = True
        gcs_tries(True)
        error: BaseException | None = None
        try:
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        except BaseException as e:  # raised in the run's thread (`connect`), or logged below
            error = e
        finally:
            gcs_tries(False)
        with self.lock:
            self.done, self.error = True, error
            if not self.gave_up:
                return
        ray.shutdown()  # what ray.init connected or set up before its error
        late = time.monotonic() - self.gave_up_at
        if error is None:
            log.warning("ray: the thread connecting to cluster.address %r connected %.1fs "
                        "after the run gave up; disconnected", self.address, late)
        else:
            log.warning("ray: the thread connecting to cluster.address %r ended %.1fs after "
                        "the run gave up: %s: %s", self.address, late, type(error).__name__,
                        str(error).splitlines()[0] if str(error) else "")

    def give_up(self) -> bool:
        """The run stops waiting: True when the thread had not finished (it undoes what it
        connects later), False when it had (its connection or error is the run's)."""
        global given_up
        with self.lock:
            if self.done:
                return False
            self.gave_up, self.gave_up_at = True, time.monotonic()
            if not self.entered:  # it returns without a ray.init, if it ever runs
                return True
        given_up += 1
        _given_up_threads.append(self.thread)
        log.warning("ray: the run gave up its connection to cluster.address %r; the thread "
                    "connecting ends by itself when Ray's attempt returns and disconnects "
                    "anything it connects (%d such thread(s) in this process)", self.address,
                    given_up)
        return True


def connect(address: str) -> None:
    """The run's own connection to the cluster at `address` (`ray.init`), within
    ADDRESS_TIMEOUT_S.
    Ray retries a GCS that does not answer for minutes and acts on signals only between its
    retries (`PROBE`), so `ray.init` runs in a thread (`_Connecting`) this process waits for.
    At the limit, or on Ctrl-C or SIGTERM, the run gives it up and raises at once (a cluster
    that stopped answering since its probe fails the run in one line naming the address and the
    limit). The thread is not stopped: it may live up to Ray's own attempt after the error
    (one try, `gcs_tries`: about 35 s against an address that never answers; more where the
    user set GCS_TRIES_ENV), and a connection it makes then it undoes itself, so it never
    leaves the process connected (logged; `given_up` counts them).
    What `ray.init` connected or set up before Ctrl-C or SIGTERM, or before its error, the run
    undoes: the process is connected only when this returns."""
    import ray

    attempt = _Connecting(address)
    interrupted = True
    try:
        attempt.thread.start()
        attempt.thread.join(ADDRESS_TIMEOUT_S)
        interrupted = False
    finally:  # the limit, Ctrl-C or SIGTERM (inside `Thread.start()` too), a failed start
        gave_up = attempt.give_up()
        if interrupted and not gave_up:
            ray.shutdown()  # what ray.init connected or set up just before Ctrl-C or SIGTERM
    if gave_up:
        raise RunError(f"ray: the run's connection to the cluster at cluster.address "
                       f"{address!r} did not finish within {ADDRESS_TIMEOUT_S:g} s (it "
                       f"answered the probe before the run started)")
    if attempt.error is not None:
        ray.shutdown()  # what the failed ray.init set up
        raise attempt.error


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
    process's death): nothing of it outlives the run, even a SIGKILLed one.
    `ray.init` puts Ray's own SIGTERM handling in place (from the main thread a Python handler
    that raises SystemExit, and its C++ core's crash handler, which aborts the process: seen
    with a local instance) and `ray.shutdown` leaves the Python one: the SIGTERM handler the
    process had before `start` is put back when `start` and `close` end (`_own_sigterm`), so
    after `start` returns `tiller train` takes SIGTERM as Ctrl-C under Ray again, and a process
    (pytest) that ran a Ray run inside it keeps its own handling of SIGTERM after it. Not
    within `start`: a SIGTERM during a local instance's `ray.init` meets Ray's handling
    (SystemExit(15), or an abort once Ray's core runs; only the guard cleans up then). Not
    checked: whether a given-up connection's thread whose `ray.init` ends after `start`
    returned installs Ray's C++ handler after the handler was put back."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.temp_dir: str | None = None
        self.reaper: subprocess.Popen | None = None
        # `connect` did not return: what it leaves is undone by it or by its thread, so `close`
        # calls no ray.shutdown() that could run beside the thread's ray.init
        self.connecting = False
        self.sigterm: Any = None  # the SIGTERM handler before `start` (main thread only)

    def start(self) -> RayCluster:
        """Connect, or start the local instance (and its guard); a start that fails stops
        what it started (nothing before a given-up connection ends: `wait_given_up`; its
        error closes nothing, so no ray.shutdown() runs beside that thread's ray.init)."""
        wait_given_up()
        if threading.current_thread() is threading.main_thread():
            self.sigterm = signal.getsignal(signal.SIGTERM)
        try:
            return self._start()
        except BaseException:
            self.close()
            raise
        finally:
            self._own_sigterm()

    def _own_sigterm(self) -> None:
        """Where the process's SIGTERM handler is Ray's, the one from before `start` back in
        its place (None: that one was not set from Python, or `start` ran outside the main
        thread); any other handler was set since `start` (the CLI's once-then-kill handler
        sets SIG_DFL when it runs) and is set again as it is, which also puts it back in the
        kernel where `ray.shutdown` reset SIGTERM's disposition under Python's table. Only
        from the main thread: elsewhere no handler can be set (ValueError)."""
        if threading.current_thread() is not threading.main_thread():
            return
        now = signal.getsignal(signal.SIGTERM)
        rays = str(getattr(now, "__module__", None) or "").split(".")[0] == "ray"
        keep = self.sigterm if rays else now
        if keep is not None:
            signal.signal(signal.SIGTERM, keep)

    def _start(self) -> RayCluster:
        import ray

        c = self.cfg.cluster
        t0 = time.perf_counter()
        if c.address is not None:
            self.connecting = True
            connect(c.address)  # its CPUs checked before any work
            self.connecting = False
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
            if not self.connecting:
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
                try:  # first: the run's handling of SIGTERM holds while the guard is waited for
                    self._own_sigterm()  # ray.shutdown left Ray's Python handler
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
