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
import fcntl
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import IO

# Only stdlib-only tiller modules: the sandbox also runs under a bare system Python (the
# unprivileged-user test executes this file with /usr/bin/python3 and tiller's src on the path).
from tiller.errors import ConfigError
from tiller.tools.launch import (
    INBOX,
    LAUNCHER,
    bwrap_argv,
    mount_problem,
    sandbox_env,
    seccomp_program,
    supervise,
)
from tiller.tools.threads import run_in_thread

logger = logging.getLogger(__name__)

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
            problem = mount_problem(path)
            if problem is not None:
                raise ValueError(f"mounts: got {path!r}; {problem}")
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
            Path(bpf_path).write_bytes(seccomp_program() or b"")
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
            cfg["inbox"] = INBOX
            if os.geteuid() == 0:
                cfg["uid"] = (1 << 30) + secrets.randbelow(1 << 30)
            bpf_fd = bpf_file.fileno() if seccomp_program() else None
            if bpf_fd is not None:
                pass_fds.append(bpf_fd)
            prefix = bwrap_argv(self.limits.tmpfs_mb, inbox, python, bpf_fd, info_w,
                                self.mounts)
            env, cwd = {}, "/"
        else:
            cfg["parent_pid"] = os.getpid()
            prefix, env, cwd = [], sandbox_env(python, home=inbox), inbox
        argv = [*prefix, python, "-I", "-S", "-c", LAUNCHER, json.dumps(cfg)]

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
            out, err, truncated, started, timed_out, info_error = supervise(
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
