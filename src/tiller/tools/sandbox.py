"""Run model-written (untrusted) Python in a sandbox: bubblewrap, or refuse (unless allowed).

Layers, and why each one is there (docs/sandbox.md has the user-facing summary):

* **bubblewrap** (`bwrap`) namespaces: no network (`--unshare-net` leaves a private, empty
  loopback), no view of host processes (`--unshare-pid`; killing pid 1 or `kill(-1)` only reaches
  the sandbox), and a filesystem holding only read-only /usr, a few /etc files, the interpreter,
  and a size-capped tmpfs at /tmp that is the cwd and HOME. `/` and `/dev` are remounted read-only,
  because otherwise they are tmpfs the code could fill without any size cap.
* **No process of bwrap's own inside** (`--as-pid-1`): bwrap's pid 1 had the caller's limits,
  held the stdin file, and for a non-root caller ran as the code's own uid, so the code could
  ptrace it or write its /proc/1/mem and make it exec anything outside the limits (a 256 MiB
  hog under `memory_mb=64`). bwrap also exits on its pid 1's status report before that pid 1
  has exited, which left one zombie bwrap per call to the host's init. Our launcher is pid 1
  instead: not dumpable (no ptrace, /proc/1/mem or /proc/1/fd for anyone without
  CAP_SYS_PTRACE), stdin closed, the same rlimits and seccomp filter as the code, and the reaper
  of every orphan; it keeps its credentials, so bwrap's `--die-with-parent` holds for it.
  Applying the limits to bwrap itself instead would not do: RLIMIT_NPROC set before the user
  namespace exists counts all of the caller's processes, and bwrap's pid 1 would still be
  dumpable with the stdin file open.
* **The interpreter is the host's own** (`sys.executable`, e.g. a venv over a pyenv build), so the
  model sees the same Python and packages as the trainer. We bind `sys.prefix`, `sys.base_prefix`
  (and exec prefixes, and the real path of the executable) read-only at the same paths. bwrap
  would create the missing parents of those paths (`/root`, `/root/.pyenv`, ...) with mode 0700,
  which the unprivileged uid below cannot traverse, so we create every parent with 0755 first;
  they live on the sandbox's own root tmpfs, and the host's `/root` is never mounted.
* **An unprivileged uid**, because RLIMIT_NPROC is not enforced for host root (the kernel exempts
  the root *user*, also inside a user namespace that maps it). As a non-root caller, bwrap makes a
  user namespace (`--unshare-user --uid 65534`) and the kernel counts processes per namespace.
  As root that would leave us root, so bwrap runs privileged (it must: an unprivileged bwrap
  cannot bind an interpreter under a 0700 `/root`) and our launcher then drops to a fresh random
  uid in [2**30, 2**31), so concurrent sandboxes do not share one process budget.
* **seccomp** denies `unshare`, `setns` and `clone(CLONE_NEWUSER)` (`clone3` answers ENOSYS so libc
  falls back to `clone`): a nested user namespace would let the code mount an uncapped tmpfs and
  spend host RAM outside RLIMIT_AS. It also denies memory that lives outside any address space
  and so outside RLIMIT_AS: System V shared memory, message queues and semaphores (`shmget`,
  `msgget`, `semget`: a 48 MiB program held 192 MiB of host shmem in detached segments until
  the IPC namespace died) and `memfd_create`/`memfd_secret` (each memfd is a RLIMIT_FSIZE-sized
  file in host RAM, one per open file). And it denies reaching into another process:
  `ptrace`, `process_vm_readv`/`process_vm_writev`, `kcmp` and `pidfd_getfd`.
* **rlimits**, set by our launcher inside the sandbox just before it execs the model's program:
  CPU seconds, address space, processes, file size, open files, no core dumps (a core would be
  handed to the host's core_pattern handler). Not `preexec_fn`: that is unsafe in a threaded
  host (`arun_python` uses threads), and it would set RLIMIT_NPROC before bwrap's user namespace
  exists, where it would count all of the caller's processes.
* **Host side**: a wall-clock deadline, then SIGKILL to the sandbox's pid 1 (bwrap's child, whose
  host pid `--info-fd` or /proc tells us; the kernel then kills its whole pid namespace), a wait
  for bwrap to reap it and exit, and bwrap is reaped: killing the outer bwrap first would leave
  its child to `--die-with-parent` and the host's init to reap. Output is read in bounded chunks
  (at most `max_output_bytes` kept per stream, the rest drained and dropped). stdin is a memfd
  sealed against writes: a fresh open of /proc/self/fd/0 ignores how fd 0 was opened.

`backend="auto"` refuses to run without a working bwrap (a one-line `ConfigError`) unless the
unsafe fallback is allowed (`allow_unsafe_fallback=True`, or `set_unsafe_fallback(True)` for the
process, as a run does from `env.tools.sandbox.allow_unsafe_fallback`). The probe that decides
it is retried before it fails. The fallback (`backend="subprocess"`) keeps only the rlimits, the
timeout, a cleared environment (the code can still read the trainer's, /proc/<ppid>/environ)
and a temp cwd, and says so with a warning for every `Sandbox` that uses it.

Outcomes: a wall-clock timeout and the CPU rlimit (SIGXCPU) are TIMEOUT; any other signal is
KILLED (e.g. SIGKILL once the hard CPU limit is hit by code that ignores SIGXCPU, SIGSEGV, SIGABRT);
running out of address space is usually ERROR (a Python `MemoryError`), or KILLED if C code aborts.
bwrap reports "killed by signal n" as exit status 128 + n, so under bwrap a deliberate
`sys.exit(128 + n)` reads as KILLED. SANDBOX_ERROR means the model's code never started (bwrap or
our launcher failed): the launcher writes one byte to a private pipe right before exec, and its
absence is the signal, so model code cannot fake an environment failure by printing "bwrap: ..."
and exiting 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import platform
import secrets
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cache
from pathlib import Path, PurePosixPath
from typing import IO, Any

# Only stdlib-only tiller modules: the sandbox also runs under a bare system Python (the
# unprivileged-user test executes this file with /usr/bin/python3 and tiller's src on the path).
from tiller.errors import ConfigError
from tiller.tools.threads import run_in_thread

logger = logging.getLogger(__name__)

_INBOX = "/inbox"  # where the code and files are bound (read-only) inside bwrap
_WORKDIR = "/tmp"  # the writable tmpfs: cwd and HOME of the sandboxed program
_RESERVED = ("/usr", "/etc", "/proc", "/dev", "/tmp", "/bin", "/sbin", "/lib", "/lib32",
             "/lib64", _INBOX)  # what `mounts` may not shadow
_NOBODY = 65534  # the uid inside a user namespace (non-root callers)
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
_INFO_MAX_BYTES = 4096  # bwrap's --info-fd JSON is a few bytes
_DRAIN_SECONDS = 0.2  # how long to keep reading pipes after the program exited or was killed
_REAP_SECONDS = 10.0  # how long bwrap may take to reap the sandbox's killed pid 1 and exit
PROBE_ATTEMPTS = 3  # test runs of bwrap before `auto` gives up on it (one failure may be transient)
PROBE_BACKOFF_S = 0.5  # sleep before the 2nd probe; doubles for each further one
MAX_CONCURRENT_RUNS = min(32, (os.cpu_count() or 1) + 4)  # `arun_python`s running at once
_run_slots = threading.BoundedSemaphore(MAX_CONCURRENT_RUNS)


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 5.0  # RLIMIT_CPU (rounded up): SIGXCPU, then SIGKILL a second later
    wall_seconds: float = 10.0  # host-side deadline, then SIGKILL
    memory_mb: int = 512  # RLIMIT_AS: address space, not RSS
    max_processes: int = 64  # RLIMIT_NPROC; counts threads (and a non-root caller's pid 1)
    max_file_mb: int = 16  # RLIMIT_FSIZE: largest file the code may write
    max_open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_mb: int = 64  # size of the writable /tmp (bwrap only)
    max_output_bytes: int = 64 * 1024  # kept per stream; the rest is read and dropped


class SandboxOutcome(str, Enum):
    OK = "ok"  # exit status 0
    ERROR = "error"  # nonzero exit status (an exception, sys.exit(n), MemoryError, ...)
    TIMEOUT = "timeout"  # wall-clock deadline or CPU rlimit (SIGXCPU)
    KILLED = "killed"  # any other signal
    SANDBOX_ERROR = "sandbox_error"  # the code never ran: an environment failure, not the policy's


@dataclass(frozen=True)
class SandboxResult:
    outcome: SandboxOutcome
    returncode: int | None  # negative: killed by that signal; None: nothing was started
    stdout: str
    stderr: str
    wall_seconds: float
    backend: str  # "bwrap" | "subprocess"
    truncated: bool = False  # some stdout/stderr was dropped

    @property
    def ok(self) -> bool:
        return self.outcome is SandboxOutcome.OK


# Runs inside the sandbox with the target interpreter (-I -S: no env, no site-packages), before
# any model code. Under bwrap it is the sandbox's pid 1 (`--as-pid-1`, so no process of bwrap's
# own is inside): it makes itself non-dumpable, forks the program's process, then takes the same
# rlimits, closes its stdin and reaps every process until the program's exits, and exits with
# its status (128 + n for signal n, as bwrap reports it). The program's process drops root,
# copies the inputs in, sets the rlimits, signals "started" and execs the program. pid 1 forks
# before it lowers its rlimits: a copy with RLIMIT_FSIZE set could not take large inputs, and
# with RLIMIT_NPROC set (non-root: pid 1 counts) `max_processes=1` could not fork at all.
_LAUNCHER = """\
# tiller sandbox launcher
import json, os, resource, shutil, signal, sys
cfg = json.loads(sys.argv[1])


def set_rlimits():  # only lowering: allowed without privileges
    for name, limit in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(limit))


def be_init(program):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its only handler: init ignores the rest
    os.close(0)  # nothing in the sandbox may reopen stdin through /proc/1/fd/0
    os.close(cfg["ready_fd"])
    set_rlimits()
    while True:
        pid, status = os.wait()  # orphans are re-parented to pid 1: reap them too
        if pid == program:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


if cfg["parent_pid"]:  # fallback only: die with the host process (bwrap has --die-with-parent)
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != cfg["parent_pid"]:
        sys.exit("sandbox launcher: host process already gone")
if cfg["init"]:  # the sandbox's pid 1 keeps its credentials, so --die-with-parent holds
    import ctypes
    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE: no ptrace, no /proc/1/mem
        sys.exit("sandbox launcher: prctl(PR_SET_DUMPABLE, 0) failed")
    program = os.fork()
    if program:
        be_init(program)
if cfg["uid"] is not None:
    os.setgroups([])
    os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
if cfg["inbox"]:  # the environment's inputs, so before the policy's limits
    for name in os.listdir(cfg["inbox"]):
        src = os.path.join(cfg["inbox"], name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, name)
set_rlimits()
if not os.access(cfg["python"], os.X_OK):
    sys.exit("sandbox launcher: cannot execute " + cfg["python"] + " as uid " + str(os.getuid()))
os.write(cfg["ready_fd"], b"1")
os.close(cfg["ready_fd"])
os.execv(cfg["python"], [cfg["python"], "-E", "-s", "-u", "main.py"])
"""


class Sandbox:
    """Runs Python source under `limits`; `backend` is "auto" (bwrap if it works, else refuse
    unless `allow_unsafe_fallback`), "bwrap" or "subprocess" (the unsandboxed fallback).
    `allow_unsafe_fallback=None` uses the process's setting (`set_unsafe_fallback`).
    `mounts` are absolute paths that get a writable tmpfs of their own (`tmpfs_mb` each), e.g.
    a Harbor task's /app, /tests and /logs (bwrap only)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), backend: str = "auto",
                 allow_unsafe_fallback: bool | None = None, mounts: Sequence[str] = ()) -> None:
        if backend not in ("auto", "bwrap", "subprocess"):
            raise ValueError(f"backend must be auto, bwrap or subprocess, not {backend!r}")
        self.mounts = list(mounts)
        for path in self.mounts:
            if not path.startswith("/") or ".." in PurePosixPath(path).parts or path == "/" \
                    or any(_under(path, d) or _under(d, path) for d in _RESERVED):
                raise ValueError(f"mounts: got {path!r}; expected an absolute path outside "
                                 f"{', '.join(_RESERVED)}")
        if not sys.executable:
            raise RuntimeError("sys.executable is unknown: no interpreter to run the code with")
        self.limits = limits
        if backend == "bwrap" and shutil.which("bwrap") is None:
            raise RuntimeError("backend='bwrap' but bubblewrap is not installed (apt bubblewrap)")
        if backend == "auto":
            problem = bwrap_problem()
            backend = "subprocess" if problem else "bwrap"
            if problem and self.mounts:  # no fallback can give them: refused, not warned
                raise ConfigError(f"cannot sandbox: {problem}; the paths "
                                  f"{', '.join(self.mounts)} exist only inside bubblewrap "
                                  "(apt-get install bubblewrap)")
            if allow_unsafe_fallback is None:
                allow_unsafe_fallback = _fallback_allowed
            if problem and not allow_unsafe_fallback:
                raise ConfigError(
                    f"cannot sandbox model-written code: {problem}; install bubblewrap "
                    "(apt-get install bubblewrap) or set env.tools.sandbox.allow_unsafe_fallback"
                    "=true to run it unsandboxed"
                )
            if problem:
                _warn_fallback(problem)
        elif backend == "subprocess":
            if self.mounts:
                raise ConfigError("this sandbox needs bubblewrap: the paths "
                                  f"{', '.join(self.mounts)} exist only inside it")
            _warn_fallback("backend='subprocess' was requested")
        self.backend = backend

    async def arun_python(
        self, code: str, stdin: str = "", files: dict[str, str | bytes] | None = None
    ) -> SandboxResult:
        """`run_python` in a thread of its own (the blocking part is waiting on pipes); at most
        `MAX_CONCURRENT_RUNS` run at once in the process, and the deadline starts after the wait
        for a slot, so queueing is not the code's timeout."""
        cancelled = threading.Event()
        try:
            return await run_in_thread(self._run_python_in_slot, code, stdin, files, cancelled)
        except asyncio.CancelledError:
            cancelled.set()  # still queued for a slot: the code must not run later
            raise

    def _run_python_in_slot(self, code: str, stdin: str, files: dict[str, str | bytes] | None,
                            cancelled: threading.Event) -> SandboxResult:
        with _run_slots:
            if cancelled.is_set():  # nobody awaits this result any more
                raise RuntimeError("sandbox run cancelled while it waited for a slot")
            return self.run_python(code, stdin, files)

    def run_python(
        self, code: str, stdin: str = "", files: dict[str, str | bytes] | None = None
    ) -> SandboxResult:
        """Run `code` as main.py in a fresh working directory that also holds `files` (relative
        paths), with `stdin` on standard input."""
        files = dict(files or {})
        if "main.py" in files:
            raise ValueError("files may not contain main.py: that is where the code goes")
        files["main.py"] = code
        # A private (0700) directory, so other host users cannot read the code or the files.
        with tempfile.TemporaryDirectory(prefix="tiller-", ignore_cleanup_errors=True) as tmp:
            inbox, bpf_path = os.path.join(tmp, "inbox"), os.path.join(tmp, "bpf")
            _write_tree(inbox, files)
            Path(bpf_path).write_bytes(_seccomp_program() or b"")
            with _sealed_file(stdin.encode()) as stdin_file, open(bpf_path, "rb") as bpf_file:
                return self._run(inbox, stdin_file, bpf_file)

    def _run(self, inbox: str, stdin_file: IO[bytes], bpf_file: IO[bytes]) -> SandboxResult:
        python = sys.executable
        ready_r, ready_w = os.pipe()
        info_r, info_w = os.pipe()  # bwrap writes {"child-pid": N} here (bwrap backend only)
        cfg = {
            "rlimits": _rlimits(self.limits),
            "python": python,
            "ready_fd": ready_w,
            "inbox": None,
            "uid": None,
            "parent_pid": None,
            "init": self.backend == "bwrap",
        }
        pass_fds = [ready_w]
        if self.backend == "bwrap":
            pass_fds.append(info_w)
            cfg["inbox"] = _INBOX
            if os.geteuid() == 0:
                cfg["uid"] = (1 << 30) + secrets.randbelow(1 << 30)
            bpf_fd = bpf_file.fileno() if _seccomp_program() else None
            if bpf_fd is not None:
                pass_fds.append(bpf_fd)
            prefix = _bwrap_argv(self.limits, inbox, python, bpf_fd, info_w, self.mounts)
            env, cwd = {}, "/"
        else:
            cfg["parent_pid"] = os.getpid()
            prefix, env, cwd = [], _sandbox_env(python, home=inbox), inbox
        argv = [*prefix, python, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)]

        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=cwd,
                pass_fds=pass_fds,
                start_new_session=True,  # its own process group, killed as a whole
            )
        except OSError as e:
            os.close(ready_r)
            os.close(info_r)
            return SandboxResult(
                SandboxOutcome.SANDBOX_ERROR, None, "", f"could not start sandbox: {e}",
                time.monotonic() - start, self.backend,
            )  # fmt: skip
        finally:
            os.close(ready_w)
            os.close(info_w)
        try:
            out, err, truncated, started, timed_out, info_error = _supervise(
                proc, ready_r, info_r, start + self.limits.wall_seconds,
                self.limits.max_output_bytes, self.backend == "bwrap",
            )
        finally:
            os.close(ready_r)
            os.close(info_r)
        wall = time.monotonic() - start

        rc = proc.returncode
        if self.backend == "bwrap" and 128 < rc < 128 + signal.NSIG:
            rc = -(rc - 128)  # bwrap reports "killed by signal n" as exit status 128 + n
        if not started or info_error:
            outcome = SandboxOutcome.SANDBOX_ERROR
        elif timed_out or rc == -signal.SIGXCPU:
            outcome = SandboxOutcome.TIMEOUT
        elif rc == 0:
            outcome = SandboxOutcome.OK
        elif rc < 0:
            outcome = SandboxOutcome.KILLED
        else:
            outcome = SandboxOutcome.ERROR
        out, err = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        if info_error:
            err += f"\nsandbox: {info_error}"
        return SandboxResult(outcome, rc, out, err, wall, self.backend, truncated)


def _supervise(
    proc: subprocess.Popen, ready_fd: int, info_fd: int, deadline: float, max_bytes: int,
    bwrap: bool,
) -> tuple[bytearray, bytearray, bool, bool, bool, str | None]:
    """Pump stdout/stderr until the program exits or `deadline` passes, keeping at most
    `max_bytes` of each, then stop and reap the sandbox (`_stop`; also when this raises).
    Returns (stdout, stderr, truncated, started, timed_out, info_error)."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    info = bytearray()
    state: dict[str, Any] = {"truncated": False, "started": False, "info_error": None}
    sel = selectors.DefaultSelector()
    for fd in (*bufs, ready_fd, info_fd):
        sel.register(fd, selectors.EVENT_READ)

    def streams_open() -> bool:
        return any(fd in sel.get_map() for fd in bufs)

    def pump(timeout: float) -> None:
        for key, _ in sel.select(max(timeout, 0)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
            elif key.fd == ready_fd:
                state["started"] = True
            elif key.fd == info_fd:
                info.extend(chunk[: _INFO_MAX_BYTES - len(info)])  # a few bytes of JSON
            else:
                buf = bufs[key.fd]
                room = max(max_bytes - len(buf), 0)
                buf += chunk[:room]
                state["truncated"] |= len(chunk) > room

    try:
        exited_at = None
        while streams_open() and time.monotonic() < deadline:
            # Something the program left behind (fallback only) may hold the pipes open.
            if exited_at is None and _exited(proc.pid):
                exited_at = time.monotonic()
            if exited_at is not None and time.monotonic() - exited_at > _DRAIN_SECONDS:
                break
            pump(min(deadline - time.monotonic(), 0.05))
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
        timed_out = not _exited(proc.pid)
        if info_fd in sel.get_map():
            pump(0)  # bwrap writes the child's pid right after it starts it
        state["info_error"] = _stop(proc, bytes(info), bwrap)
        drain_until = time.monotonic() + _DRAIN_SECONDS  # last words of a killed program
        while streams_open() and time.monotonic() < drain_until:
            pump(drain_until - time.monotonic())
        if not state["started"] and ready_fd in sel.get_map():
            pump(0)
    finally:
        if proc.returncode is None:  # something above raised: the sandbox must not outlive us
            _stop(proc, bytes(info), bwrap)
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    out, err = bufs.values()
    return out, err, state["truncated"], state["started"], timed_out, state["info_error"]


def _exited(pid: int) -> bool:
    """Whether our child `pid` has exited, without reaping it: until it is reaped its pid and
    process group id cannot be recycled, so signalling them stays safe."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _stop(proc: subprocess.Popen, info: bytes, bwrap: bool) -> str | None:
    """Kill what is left of the sandbox and reap it; returns why bwrap's --info-fd report was
    unreadable, if it was.

    Under bwrap: SIGKILL the sandbox's pid 1 (the kernel then kills its whole pid namespace) and
    wait for bwrap to reap it and exit, so nothing is left for the host's init. Its pid comes
    from --info-fd, else from /proc. Only a bwrap still running `_REAP_SECONDS` later is killed
    itself (logged: that leaves pid 1 to --die-with-parent and the host's init). Then the process
    group is killed (the fallback's program and what it left in its group; bwrap's sandbox is in
    a session of its own) while its leader is unreaped, and the leader is reaped."""
    info_error = None
    if bwrap:
        try:
            pid1 = _pid_from_info(info)
        except SandboxInfoError as e:
            logger.warning("tiller sandbox: %s; looking for the sandbox's pid 1 in /proc", e)
            info_error, pid1 = str(e), None
        signalled, give_up = False, time.monotonic() + _REAP_SECONDS
        while not _exited(proc.pid):
            if time.monotonic() > give_up:
                logger.warning("tiller sandbox: bwrap (pid %d) still runs %.0f s after its "
                               "sandbox was killed; killing bwrap", proc.pid, _REAP_SECONDS)
                break
            if not signalled:
                pid1 = pid1 or _bwrap_child(proc.pid)
                signalled = pid1 is not None and _kill_child(pid1, proc.pid)
            time.sleep(0.002)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return info_error


class SandboxInfoError(RuntimeError):
    """bwrap's `--info-fd` report could not be read: an infrastructure failure."""


def _pid_from_info(info: bytes) -> int | None:
    """The host pid of bwrap's child (the sandbox's pid 1) from its `--info-fd` report; None if
    there is none (bwrap failed, or has not started the child yet)."""
    if not info:
        return None
    try:
        return int(json.loads(info.decode())["child-pid"])
    except (ValueError, KeyError, TypeError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise SandboxInfoError(f"unreadable bwrap --info-fd output {info[:100]!r}: "
                               f"{type(e).__name__}: {e}") from e


def _bwrap_child(bwrap_pid: int) -> int | None:
    """bwrap's child from /proc (None: none yet, or a kernel without CONFIG_PROC_CHILDREN)."""
    try:
        children = Path(f"/proc/{bwrap_pid}/task/{bwrap_pid}/children").read_text().split()
    except FileNotFoundError:
        return None
    return int(children[0]) if children else None


def _kill_child(pid: int, parent: int) -> bool:
    """SIGKILL `pid` if it is `parent`'s child, through a pidfd: one whose process's parent is
    still our unreaped `parent` cannot be a recycled pid. Returns whether it was signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False  # gone and reaped by bwrap already
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        ppid = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("PPid:"))
        if ppid != parent:
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except (FileNotFoundError, ProcessLookupError):
        return False  # exited meanwhile: nothing to kill
    finally:
        os.close(pidfd)


def _rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    cpu = max(1, math.ceil(limits.cpu_seconds))
    mb = 1 << 20
    return {
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (limits.memory_mb * mb, limits.memory_mb * mb),
        "RLIMIT_NPROC": (limits.max_processes, limits.max_processes),
        "RLIMIT_FSIZE": (limits.max_file_mb * mb, limits.max_file_mb * mb),
        "RLIMIT_NOFILE": (limits.max_open_files, limits.max_open_files),
        "RLIMIT_CORE": (0, 0),
    }


def _sandbox_env(python: str, home: str) -> dict[str, str]:
    """A minimal environment. Thread pools are pinned to one thread because threads count
    against RLIMIT_NPROC (OpenBLAS would start one per host core on `import numpy`)."""
    return {
        "PATH": f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _sealed_file(data: bytes) -> IO[bytes]:
    """`data` in a memfd sealed against every write, for the code's stdin. A file on disk would
    not do: a fresh open of /proc/self/fd/0 skips the read-only open, so a non-root caller's
    sandbox (the file's owner) could rewrite it, and a root caller's random uid could rewrite a
    memfd (mode 0777) without the seals."""
    fd = os.memfd_create("tiller-stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    file = os.fdopen(fd, "r+b", buffering=0)
    view = memoryview(data)
    while view:
        view = view[file.write(view):]
    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    file.seek(0)
    return file


def _write_tree(root: str, files: dict[str, str | bytes]) -> None:
    """Write `files` under `root`, world-readable: as root, the bwrap backend copies them in as
    another uid."""
    os.mkdir(root, 0o755)
    for name, content in files.items():
        parts = PurePosixPath(name).parts
        if not parts or name.startswith("/") or ".." in parts:
            raise ValueError(f"file names must be relative paths inside the sandbox: {name!r}")
        path = os.path.join(root, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)  # despite the caller's umask
        for fname in filenames:
            os.chmod(os.path.join(dirpath, fname), 0o644)


def _python_binds() -> list[tuple[str, str]]:
    """(host path, sandbox path) pairs that let `sys.executable` start inside the sandbox: the
    prefixes it will look in, each at the path Python knows it by, from its real location."""
    exe = os.path.abspath(sys.executable)
    wanted = {
        sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(exe),
        os.path.dirname(os.path.dirname(os.path.realpath(exe))),
    }  # fmt: skip
    binds: list[tuple[str, str]] = []
    for dest in sorted(os.path.abspath(p) for p in wanted):  # parents sort before children
        if _under(dest, "/usr") or any(_under(dest, d) for _, d in binds):
            continue  # already visible
        binds.append((os.path.realpath(dest), dest))
    return binds


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _bwrap_argv(limits: SandboxLimits, inbox: str, python: str, bpf_fd: int | None,
                info_fd: int, mounts: Sequence[str] = ()) -> list[str]:
    bwrap = shutil.which("bwrap") or "bwrap"  # a full path: bwrap itself runs with an empty env
    argv = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--as-pid-1"]
    argv += ["--unshare-net"]
    argv += ["--info-fd", str(info_fd)]
    argv += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    if os.geteuid() == 0:  # privileged bwrap; the launcher drops to a random uid
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", str(_NOBODY), "--gid", str(_NOBODY)]
    argv += ["--clearenv"]
    for key, value in _sandbox_env(python, home=_WORKDIR).items():
        argv += ["--setenv", key, value]
    argv += ["--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # symlinks on merged-/usr systems
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += ["--perms", "0755", "--dir", "/etc"]
    for path in _ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", str(limits.tmpfs_mb << 20), "--perms", "1777", "--tmpfs", _WORKDIR]
    made = {"/usr", "/etc", "/proc", "/dev", _WORKDIR}
    for src, dest in _python_binds():
        for parent in reversed(PurePosixPath(dest).parents[:-1]):  # from the top, without "/"
            if str(parent) not in made:
                argv += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        argv += ["--ro-bind", src, dest]
    for path in mounts:  # writable, size-capped, under the root made read-only below
        for parent in reversed(PurePosixPath(path).parents[:-1]):
            if str(parent) not in made:
                argv += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        argv += ["--size", str(limits.tmpfs_mb << 20), "--perms", "1777", "--tmpfs", path]
    argv += ["--ro-bind", inbox, _INBOX]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", _WORKDIR]
    if bpf_fd is not None:
        argv += ["--seccomp", str(bpf_fd)]
    return argv + ["--"]


# Classic BPF for seccomp: (code, jump-if-true, jump-if-false, k).
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
# audit arch; syscalls denied outright (namespaces: unshare, setns; memory outside the address
# space: shmget, msgget, semget, memfd_create, memfd_secret; another process's memory and
# files: ptrace, process_vm_readv, process_vm_writev, kcmp, pidfd_getfd); then clone3 and clone
_SYSCALLS = {
    "x86_64": (0xC000003E, (272, 308, 29, 68, 64, 319, 447, 101, 310, 311, 312, 438), 435, 56),
    "aarch64": (0xC00000B7, (97, 268, 194, 186, 190, 279, 447, 117, 270, 271, 272, 438), 435, 220),
}


@cache
def _seccomp_program() -> bytes | None:
    """Deny creating or entering namespaces, memory that RLIMIT_AS does not count, and reaching
    into another process (ptrace and its relatives); None (and a warning) on other
    architectures."""
    if platform.machine() not in _SYSCALLS:
        logger.warning("tiller.tools.sandbox: no seccomp filter for %s; nested user namespaces, "
                       "SysV IPC, memfds and ptrace are not blocked", platform.machine())
        return None
    arch, denied, clone3, clone = _SYSCALLS[platform.machine()]
    eperm, enosys = _ERRNO | 1, _ERRNO | 38
    prog = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ, 1, 0, arch),
        (_RET, 0, 0, eperm),  # a foreign ABI (i386 via int 0x80) has other numbers: deny it all
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JGE, 0, 1, 0x40000000),
        (_RET, 0, 0, eperm),  # x32 syscalls
    ]
    for nr in denied:
        prog += [(_JEQ, 0, 1, nr), (_RET, 0, 0, eperm)]
    prog += [
        (_JEQ, 0, 1, clone3),
        (_RET, 0, 0, enosys),  # its flags live in memory we cannot inspect; libc falls back
        (_JEQ, 1, 0, clone),
        (_RET, 0, 0, _ALLOW),
        (_LD_W_ABS, 0, 0, 16),  # low half of args[0], clone's flags (little-endian)
        (_JSET, 0, 1, 0x10000000),  # CLONE_NEWUSER
        (_RET, 0, 0, eperm),
        (_RET, 0, 0, _ALLOW),
    ]
    return b"".join(struct.pack("=HBBI", *insn) for insn in prog)


@dataclass
class _Probe:
    done: bool = False
    problem: str | None = None
    failures: int = 0  # failed test runs of bwrap in this process, each one logged


_probe = _Probe()
_probe_lock = threading.Lock()
_fallback_allowed = False


def set_unsafe_fallback(allowed: bool) -> None:
    """Whether `backend="auto"` may run code unsandboxed when bwrap does not work, for every
    `Sandbox` of this process that does not say (a run sets it from its config, so it holds
    until the next run sets it; `set_unsafe_fallback(False)` resets it). Every Sandbox that
    falls back warns, so a setting left from an earlier run is never silent."""
    global _fallback_allowed
    _fallback_allowed = allowed


def probe_failures() -> int:
    """How many test runs of bwrap failed in this process (each was also logged)."""
    return _probe.failures


def bwrap_problem() -> str | None:
    """Why the bwrap backend cannot be used here (None if it can), decided once per process by
    running a trivial program: bwrap may be installed yet unusable (no user namespaces, too old).
    A failed run may be transient (a fork under memory pressure), so it is retried up to
    `PROBE_ATTEMPTS` times with backoff, each failure counted and logged; the last verdict holds
    for the process."""
    with _probe_lock:
        if not _probe.done:
            _probe.problem = _probe_bwrap()
            _probe.done = True
        return _probe.problem


def _probe_bwrap() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    for attempt in range(1, PROBE_ATTEMPTS + 1):
        result = Sandbox(backend="bwrap").run_python("print('ok')")
        if result.ok and result.stdout == "ok\n":
            return None
        _probe.failures += 1
        why = " ".join(result.stderr.split())[-300:] or "no output"
        problem = f"bwrap failed a test run ({result.outcome.value}: {why})"
        logger.warning("tiller sandbox: probe %d/%d: %s", attempt, PROBE_ATTEMPTS, problem)
        if attempt < PROBE_ATTEMPTS:
            time.sleep(PROBE_BACKOFF_S * 2 ** (attempt - 1))
    return f"{problem}, {PROBE_ATTEMPTS} times"


def _warn_fallback(reason: str) -> None:
    """Warn for every unsandboxed `Sandbox`, not once per process: the fallback may have been
    allowed by an earlier run in this process (`set_unsafe_fallback`), and must not go quiet."""
    root = " As root, RLIMIT_NPROC is not enforced either." if os.geteuid() == 0 else ""
    msg = (
        f"tiller sandbox: running model-written code WITHOUT bubblewrap ({reason}). Only rlimits, "
        "a wall-clock timeout, a cleared environment and a temp cwd apply: the code can read and "
        "write the host filesystem as this user (the trainer's environment too, through "
        "/proc/<pid>/environ), use the network, and signal host processes."
        f"{root} Install bubblewrap (apt-get install bubblewrap) to sandbox it."
    )
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
