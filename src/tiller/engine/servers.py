"""Managed servers: engine servers tiller starts as child processes, health-checks and stops.

Each server runs in its own process group (its session), so stopping it reaches every process it
spawned (vLLM's engine core, its workers): SIGTERM to the group, a grace period, then SIGKILL to
the group (always, even when an interrupt such as a second Ctrl-C cuts the grace period short),
and the leader is reaped. A server is dropped from `running` only once it is stopped, and an
interrupt while stopping one still stops the others before it is raised. A tiller killed by
SIGKILL or the OOM killer runs no cleanup, and leaves no server process running (only its
temporary folder): on Linux the leader gets SIGKILL from the kernel when the thread that
started it dies (`prctl PR_SET_PDEATHSIG`), and the whole group gets SIGKILL from the server's
watch process (`WATCH`) when the process that started it has died. The leader's signal alone
would leave what it spawned: vLLM's API server runs its engine core in a process of its own
(`VLLM::EngineCore`, whatever VLLM_ENABLE_V1_MULTIPROCESSING says; it and multiprocessing's
resource tracker outlived a SIGKILLed run by minutes, tests/test_resume.py). The
request is made by a small exec wrapper (`PDEATHSIG_EXEC`), not a `preexec_fn`, which is not
safe in a process with threads. The kernel sends that signal when the thread that started the
server exits, so servers are started from the main thread only (another is refused).

Its stdout and stderr go to `<log_dir>/<name>.log`; its temporary files (TMPDIR) go to a fresh
`tiller-<name>-*` folder in the system temp folder (short: vLLM puts its ZMQ sockets there, and a
socket path is at most 107 bytes), removed when it stops.

Start-up waits for `GET <url><health_path>` to answer 200 from a socket of the server's own
processes (on Linux, by /proc: a port taken by another process before the server bound it is an
error, not a healthy server), at most `startup_timeout_s` for all servers together; a server
that exits meanwhile is reported at once, not at the timeout. Either failure is one line naming
the server, its URL, its log file and the log's last line, and every server started is stopped
before it is raised. `ManagedServers` is a context manager and is what an engine's `close`
(registered on the run's ExitStack: success, error, Ctrl-C) stops.

The command of a server is any argv with `{port}` where its port goes: the vLLM backend starts
`python -m vllm.entrypoints.openai.api_server`; `tiller serve` can be started the same way. The
process that listens on the port must be one of the session tiller starts (the command or a
process it spawned that stays in its session): a wrapper that hands the port to a process
elsewhere (`docker run -p`, whose listener is docker-proxy's; `setsid`, `systemd-run`, a
supervisor that daemonises) is refused at start-up like another process on the port, as tiller
could neither tell its server apart nor stop it; start such a server yourself and attach it
with `engine.urls`.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from tiller.errors import RunError
from tiller.files import remove_tree

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often start-up checks health and whether a server exited
STOP_GRACE_S = 10.0  # after SIGTERM, how long a server may take to exit before SIGKILL
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal a child gets when its parent dies
# What a server's process runs first on Linux, instead of a `preexec_fn` (not safe in a process
# with threads: the forked child could deadlock before exec): a Python of its own that asks the
# kernel for SIGKILL when its parent dies (kept across exec), dies now if that parent (argv[1])
# already has, and execs the server's argv (argv[2:]). A failed prctl or exec is a line in the
# server's log and a non-zero exit, reported as any start-up exit.
PDEATHSIG_EXEC = f"""import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, signal.SIGKILL, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def start_time(pid: int) -> int | None:
    """When process `pid` started (field 22 of /proc/<pid>/stat: clock ticks after boot); None
    when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def kill_group(pgid: int, started: int | None, sig: int) -> bool:
    """`sig` to process group `pgid`, whose leader started at `started` (`start_time`; None:
    unknown), unless a process of another start time holds that number now: the group ended
    and its number was reused by someone else's, which is not signalled (False). A leader
    that is gone (its group's other processes may live on) does not stop the signal: the
    number of a group with a live process is not reused."""
    now = start_time(pgid)
    if now is not None and started is not None and now != started:
        return False
    with contextlib.suppress(ProcessLookupError):  # the whole group has exited
        os.killpg(pgid, sig)
    return True


def run_in_group(argv: list[str], env: dict[str, str], timeout_s: float
                 ) -> tuple[int | None, str, str]:
    """`argv` run to its end with `env` on top of this process's, in a process group of its
    own as a server is: its exit code (None: still running after `timeout_s`), stdout and
    stderr (undecodable bytes replaced). When it has exited, past `timeout_s` and on Ctrl-C,
    its group gets SIGKILL (`kill_group`), so nothing it started there outlives it (vLLM's
    platform detection's helpers). Its output goes to unnamed temporary files, not pipes, so
    that a process it started in a session of its own, which the kill misses and leaves
    running, cannot hold this past `timeout_s` by keeping a pipe open (review s10 F2)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # a Ctrl-C inside Popen after its fork still leaves the group running (Popen's window)
        proc: subprocess.Popen | None = None
        started = None  # until known, the leader is not reaped: its number is its group's
        try:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
            started = start_time(proc.pid)
            code: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc is not None:
                kill_group(proc.pid, started, signal.SIGKILL)
                # no bound: after SIGKILL the leader ends at once, unless it sleeps in the
                # kernel uninterruptibly (D state), which no timeout here could end either
                proc.wait()
        return code, *(read_all(f) for f in (out, err))


def read_all(f: IO[bytes]) -> str:
    """What was written to the temporary file `f`, decoded (undecodable bytes replaced)."""
    f.seek(0)
    return f.read().decode(errors="replace")


# The watch of a server, whose owner (the process that started it: a run, a Ray actor) may be
# killed: a process outside the owner's children (it forks and its parent exits: Ray kills an
# actor's direct children with it) and outside the server's process group, in a session of
# its own, that blocks on a pipe only the owner writes. EOF without the stop byte: the owner
# died, so the server's group (argv[1], its leader started at argv[2]), whatever of it lives,
# gets SIGKILL (`kill_group`: not a group that took its number since). The byte: an orderly
# stop, nothing to do.
WATCH = "\n".join(["import contextlib, os, signal, sys", inspect.getsource(start_time),
                   inspect.getsource(kill_group), """if os.fork():
    os._exit(0)
if sys.stdin.buffer.read(1) == b"":
    kill_group(int(sys.argv[1]), None if sys.argv[2] == "None" else int(sys.argv[2]),
               signal.SIGKILL)
"""])
WATCH_TAG = "tiller-server-watch"  # in each watch's command line
WATCH_START_S = 30.0  # a watch's first process (it forks the watch, then exits) ends by then


@dataclass(frozen=True)
class ServerSpec:
    """One server to start: `argv` with `{port}` where its port goes, extra environment `env`
    (on top of this process's), and the path that answers 200 once it serves."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"


@dataclass
class _Running:
    spec: ServerSpec
    url: str
    log: Path
    tmp: Path
    proc: subprocess.Popen[bytes]
    log_file: IO[bytes]
    started: int | None = None  # its leader's `start_time` (None: no /proc)
    watch: IO[bytes] | None = None  # the pipe to its watch (`WATCH`), once it started


def tiller_serve_specs(model_dir: Path, count: int, *, weights_root: Path, dtype: str,
                       threads: int | str) -> list[ServerSpec]:
    """`count` `tiller serve` processes of the model in `model_dir` (this Python, this tiller),
    loading weight versions from below `weights_root`, on the CPU with `threads` threads
    (a number or auto, `tiller serve --threads`)."""
    argv = [sys.executable, "-m", "tiller", "serve", str(model_dir), "--port", "{port}",
            "--weights-root", str(weights_root), "--dtype", dtype, "--device", "cpu",
            "--threads", str(threads)]
    return [ServerSpec(f"serve-{i}", argv) for i in range(count)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it). Another process may still take it
    before the server binds: the server then exits at start-up, which is reported at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of the file at `path` (at most `limit` characters), or a note
    that it is empty or missing."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [s for s in f.read().decode("utf-8", "replace").splitlines() if s.strip()]
    except OSError as e:
        return f"(log unreadable: {e})"
    return lines[-1].strip()[:limit] if lines else "(log empty)"


class Launched(Protocol):
    """Servers started for an engine (`ManagedServers`, or `ray_servers.RayServers` in Ray
    actors): `start` returns their URLs, `logs` their log files by URL, `exited` one line per
    server that has exited, `close` stops them."""

    def start(self) -> list[str]: ...
    def logs(self) -> dict[str, Path]: ...
    def exited(self, wait_s: float = 0.0) -> list[str]: ...
    def close(self) -> None: ...


class Launcher(Protocol):
    """What starts the servers of `specs` (`ManagedServers` is one)."""

    def __call__(self, specs: list[ServerSpec], *, log_dir: str | Path,
                 startup_timeout_s: float) -> Launched: ...


class ManagedServers:
    """The servers of `specs`, each on a free loopback port of `host`; `start()` returns their
    base URLs once every one is healthy, `close()` stops them (idempotent). Each server's
    process group gets SIGKILL when this process dies without running `close` (a run or a Ray
    actor killed or crashed), by a watch process (`WATCH`)."""

    def __init__(self, specs: list[ServerSpec], *, log_dir: str | Path,
                 startup_timeout_s: float = 300.0, host: str = "127.0.0.1"):
        self.specs = list(specs)
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.host = host
        self.running: list[_Running] = []

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.running]

    def logs(self) -> dict[str, Path]:
        return {r.url: r.log for r in self.running}

    def start(self) -> list[str]:
        """Start every server and wait until each answers its health path; on any failure
        (one exits, the timeout passes, Ctrl-C) every server started is stopped first, then
        one RunError naming the server, URL and log file is raised. From the main thread only
        (`_check_main_thread`)."""
        _check_main_thread()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for spec in self.specs:
                self.running.append(self._spawn(spec))
            self._wait_healthy()
        except BaseException:
            self.close()
            raise
        return self.urls

    def _spawn(self, spec: ServerSpec) -> _Running:
        port = free_port(self.host)
        log = self.log_dir / f"{spec.name}.log"
        tmp = Path(tempfile.mkdtemp(prefix=f"tiller-{spec.name}-"))
        argv = [a.replace("{port}", str(port)) for a in spec.argv]
        log_file = open(log, "ab")  # noqa: SIM115 - closed in _stop
        log_file.write(f"$ {' '.join(argv)}\n".encode())
        log_file.flush()
        env = {**os.environ, **spec.env, "TMPDIR": str(tmp)}
        try:
            if shutil.which(argv[0], path=env.get("PATH")) is None:  # before the wrapper runs
                raise FileNotFoundError(errno.ENOENT, "no such executable", argv[0])
            proc = subprocess.Popen(_dying_with_this_process(argv), stdout=log_file,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        except OSError as e:
            log_file.close()
            remove_tree(tmp)  # what it cannot remove: a warning each, counted
            raise RunError(f"server {spec.name}: could not start {argv[0]!r} ({e}); log "
                           f"{log}") from e
        logger.info("started server %s (pid %d) on port %d; log %s", spec.name, proc.pid, port,
                    log)
        # not reaped yet (a zombie at worst): /proc/<pid> is this server's
        running = _Running(spec, f"http://{self.host}:{port}", log, tmp, proc, log_file,
                           start_time(proc.pid))
        try:
            running.watch = _watch(proc.pid, running.started)
        except BaseException:
            _stop(running, STOP_GRACE_S)
            raise
        return running

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        waiting = list(self.running)
        while waiting:
            for r in list(waiting):
                code = r.proc.poll()
                if code is not None:
                    raise RunError(f"server {r.spec.name} ({r.url}) exited with code {code} "
                                   f"during start-up; log {r.log}: {last_line(r.log)}")
                if _healthy(r.url + r.spec.health_path) and self._owns_port(r):
                    waiting.remove(r)
            if waiting and time.monotonic() > deadline:
                r = waiting[0]
                raise RunError(f"server {r.spec.name} ({r.url}) did not answer "
                               f"{r.spec.health_path} within {self.startup_timeout_s:g} s; log "
                               f"{r.log}: {last_line(r.log)}")
            if waiting:
                time.sleep(POLL_S)

    def _owns_port(self, r: _Running) -> bool:
        """Whether what answered `r`'s health path listens from `r`'s own processes (its
        session): `free_port` picks a port that is free then, the server binds it only after
        its start-up, and meanwhile another process (another run's server of the same model)
        may take it and answer. Another process's listener is a RunError; none found (it
        closed meanwhile) is not yet (False); no /proc to tell by: True."""
        port = int(r.url.rsplit(":", 1)[1])
        found = listeners(port, self.host)
        if found is None:
            return True
        theirs = found - session_sockets(r.proc.pid)
        if theirs:
            raise RunError(f"server {r.spec.name} ({r.url}): port {port} answers "
                           f"{r.spec.health_path}, but from a socket of another process, not "
                           f"one of the session tiller started: another process took the port "
                           f"before the server bound it, or the server's command hands its "
                           f"port to a process outside that session (docker run -p, setsid, "
                           f"systemd-run, a daemonising supervisor; start such a server "
                           f"yourself and attach it with engine.urls); log {r.log}: "
                           f"{last_line(r.log)}")
        return bool(found)

    def exited(self, wait_s: float = 0.0) -> list[str]:
        """One line per server that has exited: its name, URL, exit code, log and the log's
        last line. `wait_s`: first wait up to that long (one deadline over all) for servers
        still running to exit; a SIGKILLed server closes its sockets before its exit can be
        reaped, so a caller that saw every server's connection fail asks with a few seconds."""
        deadline = time.monotonic() + wait_s
        for r in self.running if wait_s > 0 else []:
            with contextlib.suppress(subprocess.TimeoutExpired):  # still running: not exited
                r.proc.wait(max(0.0, deadline - time.monotonic()))
        return [f"server {r.spec.name} ({r.url}) exited with code {r.proc.poll()}; log "
                f"{r.log}: {last_line(r.log)}" for r in self.running if r.proc.poll() is not None]

    def check_alive(self) -> None:
        """RunError naming the first server that has exited, its code and log."""
        exited = self.exited()
        if exited:
            raise RunError(exited[0])

    def close(self) -> None:
        """Stop every server (SIGTERM to its group, `STOP_GRACE_S`, then SIGKILL), reap it and
        remove its temporary folder; each leaves `running` once stopped. An interrupt (Ctrl-C)
        while one stops still SIGKILLs it and the rest (no grace), then is raised. Idempotent."""
        interrupted: BaseException | None = None
        for r in reversed(list(self.running)):
            try:  # after an interrupt the user wants out: no grace for the rest
                _stop(r, 0.0 if interrupted else STOP_GRACE_S)
            except BaseException as e:  # raised below, once the others are stopped
                interrupted = interrupted or e
                if r.proc.returncode is None:  # not reaped: the next close stops it
                    continue
            self.running.remove(r)
        if interrupted is not None:
            raise interrupted

    def __enter__(self) -> ManagedServers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def listeners(port: int, host: str) -> set[int] | None:
    """The inodes of the TCP sockets that listen on `port` at `host` or at any address (IPv4
    and IPv6; every address when `host` is not an IPv4 literal), from /proc/net/tcp and tcp6;
    None where neither can be read."""
    try:  # /proc/net/tcp writes each 32-bit word of an address in host byte order
        word = f"{struct.unpack('=I', socket.inet_aton(host))[0]:08X}"
        mine: set[str] | None = {word, "0" * 8, "0" * 32, "0" * 16 + "FFFF0000" + word}
    except OSError:
        mine = None
    found, read = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        read = True
        for row in rows:  # sl local_address rem_address st ... inode
            f = row.split()
            address, _, hex_port = f[1].rpartition(":")
            if f[3] == "0A" and int(hex_port, 16) == port and (mine is None or address in mine):
                found.add(int(f[9]))
    return found if read else None


def session_sockets(sid: int) -> set[int]:
    """The inodes of the sockets open in the processes of session `sid` (those this user may
    read: a session tiller started is its user's)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            with open(proc / "stat") as f:  # pid (comm) state ppid pgrp session ...
                if int(f.read().rsplit(")", 1)[1].split()[3]) != sid:
                    continue
            for fd in (proc / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    found.add(int(link[8:-1]))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or not ours to read
    return found


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:  # noqa: S310 - our loopback URL
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _dying_with_this_process(argv: list[str]) -> list[str]:
    """`argv` run by `PDEATHSIG_EXEC` on Linux (elsewhere as it is)."""
    if sys.platform != "linux":
        return argv
    return [sys.executable, "-I", "-S", "-c", PDEATHSIG_EXEC, str(os.getpid()), *argv]


def _check_main_thread() -> None:
    """The kernel sends PR_SET_PDEATHSIG's signal when the *thread* that started a server
    exits, so on Linux only the main thread, which lives as long as the process, may start
    servers: from another thread, one RunError."""
    if sys.platform == "linux" and threading.current_thread() is not threading.main_thread():
        raise RunError(f"managed servers are started from the main thread only, not from "
                       f"thread {threading.current_thread().name!r}: the kernel kills a "
                       f"server (PR_SET_PDEATHSIG) when the thread that started it exits")


def _watch(pgid: int, started: int | None) -> IO[bytes]:
    """Start the watch of process group `pgid`, whose leader started at `started`
    (`start_time`) (`WATCH`); the pipe whose EOF it waits for. A watch that did not start (its
    first process exits non-zero, or not within `WATCH_START_S`) is a RunError."""
    watch = subprocess.Popen([sys.executable, "-c", WATCH, str(pgid), str(started), WATCH_TAG],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True, bufsize=0)
    assert watch.stdin is not None
    try:
        code = watch.wait(WATCH_START_S)  # the parent of the fork, which exits at once
    except subprocess.TimeoutExpired as e:
        watch.kill()
        watch.wait()
        raise RunError(f"the watch of server group {pgid} did not start within "
                       f"{WATCH_START_S:g} s") from e
    if code != 0:
        raise RunError(f"the watch of server group {pgid} exited with code {code} at start")
    return watch.stdin


def _stop(r: _Running, grace_s: float) -> None:
    """SIGTERM to `r`'s group, at most `grace_s` for the leader to exit, then SIGKILL to the
    group (whatever cut the wait short), reap the leader, close the log, remove its TMPDIR."""
    pgid = r.proc.pid  # start_new_session: the leader's pid is the group's id
    try:
        if not kill_group(pgid, r.started, signal.SIGTERM):  # reaped before (`exited`)
            logger.warning("server %s: its process group's number %d is another process's "
                           "now; not signalled", r.spec.name, pgid)
        try:
            r.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("server %s did not stop within %g s of SIGTERM; SIGKILL",
                           r.spec.name, grace_s)
    finally:  # also when an interrupt cut the grace short
        kill_group(pgid, r.started, signal.SIGKILL)  # what is left of it (engine workers)
        r.proc.wait()
        if r.watch is not None:  # the stop byte: the watch exits without a kill
            try:
                r.watch.write(b"x")
            except BrokenPipeError:  # someone killed the watch: nothing left to tell
                logger.warning("server %s: its watch process had exited before the stop",
                               r.spec.name)
            finally:
                r.watch.close()
        r.log_file.close()
        remove_tree(r.tmp)  # what it cannot remove: a warning each, counted
    logger.info("stopped server %s (exit code %s)", r.spec.name, r.proc.returncode)
