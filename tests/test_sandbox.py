"""Adversarial tests for tiller.tools.sandbox.

Every hostile payload is bounded by its own code (a hard cap on forks, bytes allocated, bytes
written, output printed, seconds slept) and runs under low limits with a short wall timeout, so
even a sandbox that failed to contain it could not take the machine down. Payloads that would be
destructive outside a sandbox (signalling everything) first check that they are in a pid
namespace and refuse otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tiller.config import ConfigError
from tiller.tools import launch
from tiller.tools import sandbox as sb
from tiller.tools.sandbox import Sandbox, SandboxLimits, SandboxOutcome

HAS_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAS_BWRAP, reason="bubblewrap (bwrap) is not installed")

LIMITS = SandboxLimits(
    cpu_seconds=1,
    wall_seconds=4,
    memory_mb=256,
    max_processes=16,
    max_file_mb=8,
    tmpfs_mb=16,
    max_output_bytes=4096,
)

# Refuse to run a destructive payload unless we are inside bwrap's pid namespace (our parent is
# its pid 1, tiller's launcher), so a broken sandbox cannot turn kill(-1) loose on the host.
IN_PID_NAMESPACE = (
    "import os, sys\n"
    "pid1 = open('/proc/1/cmdline', 'rb').read()\n"
    "if os.getppid() != 1 or b'tiller sandbox launcher' not in pid1:\n"
    "    print('REFUSED: not in a pid namespace'); sys.exit(99)\n"
)

# A busy loop that ends by itself after 30 s, so a sandbox that failed to stop it cannot hang
# the test run.
BUSY_LOOP = "import time\nt0 = time.monotonic()\nwhile time.monotonic() < t0 + 30:\n    pass\n"


@pytest.fixture(scope="module")
def box() -> Sandbox:
    if not HAS_BWRAP:
        pytest.skip("bubblewrap (bwrap) is not installed")
    return Sandbox(LIMITS, backend="bwrap")


@pytest.fixture
def fallback(monkeypatch) -> Sandbox:
    with pytest.warns(RuntimeWarning, match="WITHOUT bubblewrap"):
        return Sandbox(LIMITS, backend="subprocess")


def _sleepers(token: str) -> list[int]:
    """Host pids of `sleep <token>` processes (exactly that command line, not a parent's source
    code mentioning the token)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(f"/proc/{entry}/cmdline").read_bytes() == (
                b"sleep\0" + token.encode() + b"\0"
            ):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _assert_no_sleepers(token: str) -> None:
    deadline = time.monotonic() + 2
    while (left := _sleepers(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # clean up before failing, so a broken sandbox leaves nothing behind
        os.kill(pid, signal.SIGKILL)
    assert not left, f"sandboxed processes outlived the sandbox: {left}"


def _sleep_token() -> str:
    """A unique argument for sleep(1), so its processes can be found on the host."""
    return f"9.{secrets.randbelow(10**9):09d}"


# --- normal programs --------------------------------------------------------------------------


@needs_bwrap
def test_normal_program(box: Sandbox) -> None:
    code = (
        "import os, sys\n"
        "print(sys.stdin.read().upper())\n"
        "print(open('data/in.txt').read(), open('blob.bin', 'rb').read())\n"
        "open('out.txt', 'w').write('scratch')\n"
        "print(sys.executable, sys.prefix, sys.base_prefix, os.getuid() != 0, os.getcwd())\n"
        "sys.exit(3)\n"
    )
    files = {"data/in.txt": "from a file", "blob.bin": b"\x00\x01"}
    r = box.run_python(code, stdin="hello", files=files)
    assert r.backend == "bwrap"
    assert r.outcome is SandboxOutcome.ERROR and r.returncode == 3, r
    lines = r.stdout.splitlines()
    assert lines[0] == "HELLO"
    assert lines[1] == "from a file b'\\x00\\x01'"
    # The same interpreter (venv and base), as an unprivileged uid, in the tmpfs workdir.
    assert lines[2] == f"{sys.executable} {sys.prefix} {sys.base_prefix} True /tmp"


@needs_bwrap
def test_ok_and_exception(box: Sandbox) -> None:
    assert box.run_python("print('hi')").outcome is SandboxOutcome.OK
    r = box.run_python("raise ValueError('boom')")
    assert r.outcome is SandboxOutcome.ERROR and r.returncode == 1
    assert "ValueError: boom" in r.stderr


@needs_bwrap
def test_venv_packages_are_importable(box: Sandbox) -> None:
    pytest.importorskip("numpy")
    r = box.run_python("import numpy; print(numpy.arange(4).sum())")
    assert r.ok and r.stdout == "6\n", r


@needs_bwrap
def test_async_runs_concurrently(box: Sandbox) -> None:
    async def main():
        return await asyncio.gather(*(box.arun_python(f"print({i} * 2)") for i in range(4)))

    results = asyncio.run(main())
    assert [r.stdout for r in results] == ["0\n", "2\n", "4\n", "6\n"]


def test_bad_file_names_are_rejected(fallback: Sandbox) -> None:
    for name in ("../escape.txt", "/etc/passwd", "a/../../b", "main.py", ""):
        with pytest.raises(ValueError):
            fallback.run_python("print('never runs')", files={name: "x"})


# --- containment ------------------------------------------------------------------------------


@needs_bwrap
def test_no_network_even_to_host_loopback(box: Sandbox) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # control: the host can
            server.accept()[0].close()
        code = (
            "import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=1)\n"
            "        print('CONNECTED', addr)\n"
            "    except OSError as e:\n"
            "        print('blocked', addr, type(e).__name__)\n"
        )
        r = box.run_python(code)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing from the sandbox reached the listener
    assert r.ok, r
    assert "CONNECTED" not in r.stdout and r.stdout.count("blocked") == 2


@needs_bwrap
def test_cannot_read_host_files(box: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    code = (
        "import json, os\n"
        f"for path in [{str(secret)!r}, '/etc/shadow', '/etc/passwd', '/proc/1/root/etc/shadow']:\n"
        "    try:\n"
        "        print('READ', path, open(path).read())\n"
        "    except OSError as e:\n"
        "        print('denied', path, type(e).__name__)\n"
        "print(json.dumps(os.listdir('/')))\n"
    )
    r = box.run_python(code)
    assert r.ok, r
    assert "TOPSECRET" not in r.stdout and "READ" not in r.stdout
    # Only what we mounted: no /home, /var, /mnt, /work/main/src, ...
    top = set(json.loads(r.stdout.splitlines()[-1]))
    assert top <= {"bin", "dev", "etc", "inbox", "lib", "lib32", "lib64", "proc", "sbin", "tmp",
                   "usr", *(Path(p).parts[1] for p in {sys.prefix, sys.base_prefix})}  # fmt: skip


@needs_bwrap
def test_cannot_write_outside_tmpfs(box: Sandbox, tmp_path: Path) -> None:
    name = f"pwned-{secrets.token_hex(4)}"
    targets = [tmp_path / name, Path(sys.prefix) / name, Path(sys.base_prefix) / name]
    inside_only = ["/" + name, "/usr/" + name, "/etc/" + name, "/dev/shm/" + name, "/inbox/" + name]
    code = (
        f"for path in {[str(t) for t in targets] + inside_only!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x'); print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('denied', path, type(e).__name__)\n"
        "import os\n"
        "try:\n"
        "    os.write(0, b'x'); print('WROTE stdin')  # fd 0 is the host's copy of stdin\n"
        "except OSError as e:\n"
        "    print('denied stdin', type(e).__name__)\n"
        "try:  # a fresh open ignores fd 0's read-only mode\n"
        "    open('/proc/self/fd/0', 'r+b', buffering=0).write(b'x'); print('WROTE stdin')\n"
        "except OSError as e:\n"
        "    print('denied stdin reopened', type(e).__name__)\n"
    )
    try:
        r = box.run_python(code)
        assert r.ok, r
        assert "WROTE" not in r.stdout, r.stdout
        assert not any(t.exists() for t in targets)
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


@needs_bwrap
def test_fork_bomb_is_capped(box: Sandbox) -> None:
    token = _sleep_token()
    code = (
        "import os\n"
        "forked = 0\n"
        "for _ in range(500):  # hard cap, whatever the sandbox does\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n"
        "        print('fork failed:', e.strerror); break\n"
        "    if pid == 0:\n"
        f"        os.execv('/usr/bin/sleep', ['sleep', {token!r}])\n"
        "    forked += 1\n"
        "print('forked', forked)\n"
    )
    r = box.run_python(code)
    assert r.ok, r
    assert "fork failed" in r.stdout
    assert int(r.stdout.split()[-1]) < LIMITS.max_processes
    _assert_no_sleepers(token)  # the children died with the sandbox


@needs_bwrap
def test_memory_bomb_is_capped(box: Sandbox) -> None:
    code = (
        "chunks = []\n"
        "for _ in range(32):  # 32 x 64 MiB = 2 GiB hard cap, touched\n"
        "    chunks.append(bytearray(b'\\x01') * (64 << 20))\n"
        "print('ALLOCATED 2GiB')\n"
    )
    r = box.run_python(code)
    assert r.outcome in (SandboxOutcome.ERROR, SandboxOutcome.KILLED), r
    assert "ALLOCATED" not in r.stdout
    assert r.outcome is SandboxOutcome.KILLED or "MemoryError" in r.stderr


@needs_bwrap
def test_memory_limit_applies_to_every_process() -> None:
    """RLIMIT_AS is per process: children are capped too (so the sandbox's total is bounded by
    max_processes x memory_mb, not by memory_mb)."""
    box = Sandbox(SandboxLimits(memory_mb=128, max_processes=8, wall_seconds=4), backend="bwrap")
    code = (
        "import os\n"
        "for _ in range(4):  # hard cap: 4 children x 256 MiB\n"
        "    if os.fork() == 0:\n"
        "        got, chunks = 0, []\n"
        "        try:\n"
        "            for _ in range(16):\n"
        "                chunks.append(bytearray(b'\\x01') * (16 << 20)); got += 16\n"
        "        except MemoryError:\n"
        "            pass\n"
        "        os.write(1, f'child {got}\\n'.encode())  # one write: lines never interleave\n"
        "        os._exit(0)\n"
        "for _ in range(4):\n"
        "    os.wait()\n"
    )
    r = box.run_python(code)
    assert r.ok, r
    got = [int(line.split()[1]) for line in r.stdout.splitlines()]
    assert len(got) == 4 and all(0 < mb < 128 for mb in got), r.stdout


@needs_bwrap
def test_infinite_loop_hits_cpu_limit(box: Sandbox) -> None:
    r = box.run_python(BUSY_LOOP)
    # The CPU limit (1 s) should win; on a busy machine the wall clock (4 s) may come first.
    # Either outcome proves the bound, and SIGXCPU is checked when it is the CPU limit.
    assert r.outcome is SandboxOutcome.TIMEOUT, r
    assert r.returncode == -signal.SIGXCPU or r.wall_seconds >= LIMITS.wall_seconds, r


@needs_bwrap
def test_wall_timeout_kills_everything() -> None:
    box = Sandbox(SandboxLimits(wall_seconds=1), backend="bwrap")
    token = _sleep_token()
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen(['sleep', {token!r}], start_new_session=True)\n"
        "print('started', flush=True)\n"
        "time.sleep(9)  # bounded\n"
    )
    r = box.run_python(code)
    assert r.outcome is SandboxOutcome.TIMEOUT, r
    assert 1 <= r.wall_seconds < 9  # killed at the 1 s deadline, long before the 9 s sleep
    assert r.stdout == "started\n"  # output written before the kill is kept
    _assert_no_sleepers(token)  # even the child in its own session is gone


@needs_bwrap
def test_output_flood_is_bounded(box: Sandbox) -> None:
    r = box.run_python("for _ in range(50_000):  # 50 MB hard cap\n    print('x' * 999)\n")
    assert r.truncated
    assert len(r.stdout) <= LIMITS.max_output_bytes
    assert r.outcome in (SandboxOutcome.OK, SandboxOutcome.TIMEOUT), r


@needs_bwrap
def test_huge_file_is_capped(box: Sandbox) -> None:
    code = (
        "with open('big.bin', 'wb') as f:\n"
        "    for _ in range(64):  # 64 MiB hard cap\n"
        "        f.write(b'x' * (1 << 20))\n"
        "print('WROTE 64MiB')\n"
    )
    r = box.run_python(code)
    assert r.outcome is SandboxOutcome.ERROR and "File too large" in r.stderr, r
    assert "WROTE" not in r.stdout


@needs_bwrap
def test_tmpfs_is_capped(box: Sandbox) -> None:
    code = (
        "for i in range(16):  # 16 files x 4 MiB = 64 MiB hard cap, each under the file limit\n"
        "    with open(f'part{i}.bin', 'wb') as f:\n"
        "        f.write(b'x' * (4 << 20))\n"
        "print('WROTE 64MiB')\n"
    )
    r = box.run_python(code)
    assert r.outcome is SandboxOutcome.ERROR and "No space left on device" in r.stderr, r


@needs_bwrap
def test_killing_parent_and_everything_stays_inside(box: Sandbox) -> None:
    sentinel = subprocess.Popen(["sleep", "30"])  # a host process of the same (host) user
    code = IN_PID_NAMESPACE + (
        "import signal\n"
        "for target in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError as e:\n"
        "        print('kill', target, type(e).__name__)\n"
        "print('still here', flush=True)\n"
        "os.killpg(0, signal.SIGKILL)\n"
    )
    try:
        r = box.run_python(code)
        assert "REFUSED" not in r.stdout
        assert "still here" in r.stdout
        assert r.outcome is SandboxOutcome.KILLED and r.returncode == -signal.SIGKILL, r
        assert sentinel.poll() is None, "a host process was killed from inside the sandbox"
    finally:
        sentinel.kill()
        sentinel.wait()


@pytest.mark.integration
@needs_bwrap
def test_host_crash_takes_the_sandbox_down() -> None:
    token = _sleep_token()
    host = (
        "from tiller.tools.sandbox import Sandbox\n"
        "Sandbox(backend='bwrap').run_python(\n"
        f"    \"import subprocess; subprocess.run(['sleep', {token!r}])\")\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", host])
    try:
        deadline = time.monotonic() + 30  # the interpreter and imports start slowly on a busy host
        while not _sleepers(token) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _sleepers(token), "the sandboxed program never started"
    finally:
        trainer.kill()  # the trainer dies without any cleanup
        trainer.wait()
    _assert_no_sleepers(token)


@needs_bwrap
def test_nested_user_namespaces_are_blocked(box: Sandbox) -> None:
    code = (
        "import ctypes, subprocess, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())  # CLONE_NEWUSER\n"
        "print('tool', subprocess.run(['unshare', '-U', 'true']).returncode)\n"
        "t = threading.Thread(target=print, args=('thread ok',)); t.start(); t.join()\n"
    )
    r = box.run_python(code)
    assert r.ok, r
    assert r.stdout.splitlines() == ["unshare -1 1", "tool 1", "thread ok"]  # 1 == EPERM


def _host_shmem_mib() -> float:
    """Host RAM in shared memory (SysV segments, memfds, tmpfs), from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


# Tries to hold 6 x 32 MiB of SysV shared memory (attached, written, detached: outside the
# address space once detached) and 6 x 16 MiB in memfds (written, never mapped), then holds it
# for a second; bounded at 288 MiB and 12 objects whatever the sandbox does.
MEMORY_OUTSIDE_ADDRESS_SPACE = """\
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
MB = 1 << 20
shm = memfd = 0
for _ in range(6):
    sid = libc.shmget(0, 32 * MB, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if sid < 0:
        print('shmget errno', ctypes.get_errno())
        break
    addr = libc.shmat(sid, None, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        break
    ctypes.memset(addr, 1, 32 * MB)
    libc.shmdt(ctypes.c_void_p(addr))
    shm += 32
fds = []
for _ in range(6):
    try:
        fds.append(os.memfd_create('hog'))
        for _ in range(16):
            os.write(fds[-1], b'x' * MB)
            memfd += 1
    except OSError as e:
        print('memfd', e.errno)
        break
print('held', shm, memfd, flush=True)
time.sleep(1)
"""


@needs_bwrap
def test_memory_outside_the_address_space_is_denied() -> None:
    """RLIMIT_AS only counts mapped memory: detached SysV segments and unmapped memfds used to
    let a 48 MiB sandbox grow host shared memory by 192 MiB. seccomp now denies both."""
    box = Sandbox(replace(LIMITS, memory_mb=48, wall_seconds=6), backend="bwrap")
    before = _host_shmem_mib()
    peak, done = [before], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _host_shmem_mib())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = box.run_python(MEMORY_OUTSIDE_ADDRESS_SPACE)
    finally:
        done.set()
        watcher.join()
    assert r.ok, r
    assert r.stdout.splitlines() == ["shmget errno 1", "memfd 1", "held 0 0"]  # EPERM
    # other processes on the host (4 busy neighbours) move Shmem; the payload adds >= 192 MiB
    assert peak[0] - before < 128, f"host shared memory grew by {peak[0] - before:.0f} MiB"


# Run in a fresh interpreter that is a child subreaper: any process the sandbox leaves behind
# (an orphan bwrap, a zombie, a program's child) is re-parented to it and shows up as its
# child. Each leftover is described, then killed and reaped, so the next program starts clean.
# Its address space is capped at 1 GiB, whatever the sandbox does.
REAPER = """\
import ctypes, glob, json, os, resource, signal, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from tiller.tools import launch, sandbox as sb
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
report = {}
for name, (code, wall, info_max) in json.loads(sys.argv[1]).items():
    launch._INFO_MAX_BYTES = info_max
    r = sb.Sandbox(sb.SandboxLimits(wall_seconds=wall), backend='bwrap').run_python(code)
    left = [int(p) for f in glob.glob('/proc/self/task/*/children') for p in open(f).read().split()]
    seen = []
    for pid in left:
        try:
            stat = open(f'/proc/{pid}/stat').read()
            seen.append(stat[stat.index('(') : stat.rindex(')') + 3])  # "(comm) state"
            os.kill(pid, signal.SIGKILL)
        except OSError:
            seen.append('gone')
        os.waitpid(pid, 0)
    report[name] = [r.outcome.value, seen]
print(json.dumps(report))
"""

# Each program is bounded by its own code (9 s of sleep at most, 8 children).
LEFTOVER_PROGRAMS = {
    "ok": ("print('hi')", 20, 4096),
    "hostile": (IN_PID_NAMESPACE + (
        "import signal, time\n"
        "for _ in range(8):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid(); time.sleep(9); os._exit(0)  # bounded\n"
        "for target in (1, -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
    ), 20, 4096),
    "timeout": ("import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(9)  # bounded\n",
                1, 4096),
    "killed": ("import os, signal, time\nos.fork()\nos.killpg(0, signal.SIGKILL)\ntime.sleep(9)\n",
               20, 4096),
    # bwrap's --info-fd report cut short: the sandbox must still be stopped and reaped
    "info_error": ("import time\ntime.sleep(9)  # bounded\n", 1, 5),
}


@pytest.mark.integration
@needs_bwrap
def test_no_process_of_the_sandbox_survives_the_call() -> None:
    """After a normal, a hostile, a timed-out and a killed program, nothing the sandbox started
    is left: no zombie, no live process. bwrap's own pid 1 used to outlive every call that did
    not time out: bwrap exits on its pid 1's status report, before that pid 1 has exited, so the
    pid 1 became a zombie of the host's init (found as 27 zombie bwraps after this file's
    tests). Killing only the outer bwrap (the timeout and the unreadable --info-fd paths) left
    the same orphan."""
    env = {**os.environ, "PYTHONPATH": str(Path(sb.__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-c", REAPER, json.dumps(LEFTOVER_PROGRAMS)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "ok": ["ok", []], "hostile": ["ok", []], "timeout": ["timeout", []],
        "killed": ["killed", []], "info_error": ["sandbox_error", []],
    }  # fmt: skip


# --- sandbox failures are reported as such ----------------------------------------------------


@needs_bwrap
def test_bwrap_setup_failure_is_sandbox_error(monkeypatch) -> None:
    missing = f"/nonexistent-{secrets.token_hex(4)}"
    monkeypatch.setattr(launch, "_python_binds", lambda: [(missing, missing)])
    r = Sandbox(LIMITS, backend="bwrap").run_python("print('never runs')")
    assert r.outcome is SandboxOutcome.SANDBOX_ERROR, r
    assert "bwrap:" in r.stderr and r.stdout == ""


@needs_bwrap
def test_unreadable_info_fd_is_sandbox_error_and_still_kills(monkeypatch) -> None:
    """A partial `--info-fd` read (here: cut to 5 bytes) is the infrastructure's failure, not
    the policy's, and the sandbox is still killed (through the process group)."""
    monkeypatch.setattr(launch, "_INFO_MAX_BYTES", 5)
    token = _sleep_token()
    code = (f"import subprocess, time\nsubprocess.Popen(['sleep', {token!r}])\n"
            "time.sleep(9)  # bounded\n")
    r = Sandbox(SandboxLimits(wall_seconds=1), backend="bwrap").run_python(code)
    assert r.outcome is SandboxOutcome.SANDBOX_ERROR, r
    assert "unreadable bwrap --info-fd" in r.stderr
    _assert_no_sleepers(token)


@needs_bwrap
def test_model_cannot_fake_a_sandbox_error(box: Sandbox) -> None:
    code = 'import sys\nsys.stderr.write("bwrap: Can\'t mount proc\\n")\nsys.exit(1)\n'
    assert box.run_python(code).outcome is SandboxOutcome.ERROR


# --- an unprivileged caller -------------------------------------------------------------------
#
# As a non-root caller, bwrap makes a user namespace and every process in the sandbox runs as
# the caller's uid. These tests drive the sandbox as such a caller: as `nobody` (through
# runuser, with a Python that user can run) when the tests run as root, as this test's own user
# and Python otherwise; the attack is the same either way. They never skip once bwrap is
# installed: a caller that cannot be set up fails, naming what is missing. tiller's sandbox
# module comes on stdin (it imports only stdlib-only tiller modules). The driver caps its own
# address space (1 GiB) and CPU time (60 s), so that a sandbox that failed to contain a payload
# could not take the machine down, and it is a child subreaper: anything the sandbox leaves
# behind becomes its child, is counted, killed and reaped.

NOBODY_DRIVER = """\
import ctypes, glob, json, os, resource, signal, sys, types
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
resource.setrlimit(resource.RLIMIT_CPU, (60, 60))
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
sys.path.insert(0, sys.argv[1])
mod = types.ModuleType('sandbox_under_test'); sys.modules[mod.__name__] = mod
exec(compile(sys.stdin.read(), 'sandbox.py', 'exec'), mod.__dict__)
limits, payload, stdin = json.loads(sys.argv[2])
r = mod.Sandbox(mod.SandboxLimits(**limits), backend='bwrap').run_python(payload, stdin=stdin)
left = [int(p) for f in glob.glob('/proc/self/task/*/children') for p in open(f).read().split()]
for pid in left:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(json.dumps([r.outcome.value, r.stdout, r.stderr, len(left)]))
"""
CALLER_ENV = {"PATH": "/usr/bin:/bin"}


def unprivileged_python(euid: int) -> list[str]:
    """The command that runs a Python as an unprivileged caller: this test's own Python when
    `euid` is not root; as root, `runuser -u nobody --` and the first Python >= 3.10 that
    nobody can run (this test's own may sit in a folder only root can read). Fails, naming
    what is missing, when there is none: a security test must not pass without running."""
    if euid != 0:
        return [sys.executable]
    runuser = shutil.which("runuser")
    if runuser is None:
        pytest.fail("runuser (util-linux) is needed to run the sandbox as nobody from root")
    tried = []
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        command = [runuser, "-u", "nobody", "--", python]
        out = subprocess.run([*command, "-c", "import sys; print(sys.version_info >= (3, 10))"],
                             capture_output=True, text=True, timeout=30, env=CALLER_ENV,
                             cwd="/")  # fmt: skip
        if out.stdout.strip() == "True":
            return command
        tried.append(f"{python}: {(out.stdout + out.stderr).strip()[-200:] or out.returncode}")
    pytest.fail(f"no Python >= 3.10 that nobody can run ({'; '.join(tried)})")


@pytest.fixture(scope="module")
def unprivileged() -> list[str]:
    """`unprivileged_python`'s command, once bwrap made a user namespace with it (fails when
    it cannot: tiller's sandbox would not run for such a caller either)."""
    if not HAS_BWRAP:
        pytest.skip("bubblewrap (bwrap) is not installed")
    python = unprivileged_python(os.geteuid())
    probe = "import subprocess; subprocess.run(['bwrap', '--unshare-user', '--ro-bind', '/', " \
            "'/', 'true'], check=True)"
    userns = subprocess.run([*python, "-c", probe], capture_output=True, text=True, timeout=30,
                            env=CALLER_ENV, cwd="/")
    if userns.returncode != 0:
        pytest.fail(f"bwrap cannot make a user namespace for an unprivileged caller here: "
                    f"{userns.stderr[-300:]}")
    return python


def _run_unprivileged(python: list[str], payload: str, stdin: str = "", **limits: Any
                      ) -> tuple[str, str, str, int]:
    """(outcome, stdout, stderr, leftover processes) of `payload` run in the sandbox by the
    unprivileged caller `python`."""
    args = [str(Path(sb.__file__).parents[2]), json.dumps([limits, payload, stdin])]
    proc = subprocess.run([*python, "-I", "-c", NOBODY_DRIVER, *args],
                          input=Path(sb.__file__).read_text(), capture_output=True, text=True,
                          timeout=90, env=CALLER_ENV, cwd="/")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    outcome, stdout, stderr, left = json.loads(proc.stdout)
    return outcome, stdout, stderr, left


@pytest.mark.integration
def test_an_unprivileged_caller_is_found_as_root_and_as_another_user() -> None:
    """Neither case skips: the command found runs a Python >= 3.10 as a user other than root:
    this test's own user when it is not root, nobody when it is."""
    expected = pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else os.geteuid()
    probe = "import os, sys; print(os.geteuid(), sys.version_info >= (3, 10))"
    ran = subprocess.run([*unprivileged_python(os.geteuid()), "-c", probe], capture_output=True,
                         text=True, timeout=30, env=CALLER_ENV, cwd="/")
    assert ran.returncode == 0, ran.stderr[-500:]
    assert ran.stdout.split() == [str(expected), "True"] and expected != 0


@pytest.mark.integration
def test_unprivileged_caller_gets_a_user_namespace(unprivileged) -> None:
    """The non-root path: bwrap makes a user namespace, RLIMIT_NPROC counts inside it, and the
    namespace-owned / and /dev are read-only."""
    payload = (
        "import os, sys, time\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(5); os._exit(0)\n"
        "    n += 1\n"
        "wrote = 0\n"
        "for path in ('/x', '/dev/shm/x', '/etc/x'):  # uncapped tmpfs if writable\n"
        "    try:\n"
        "        open(path, 'w').write('x'); wrote += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "print(os.getuid(), n, wrote)\n"
    )
    outcome, stdout, stderr, left = _run_unprivileged(unprivileged, payload, max_processes=8,
                                                      wall_seconds=4)
    assert outcome == "ok", stderr
    uid, forked, wrote = map(int, stdout.split())
    assert uid == 65534 and forked < 8 and wrote == 0 and left == 0


# Everything a process of the sandbox could do to another one of the same uid, pid 1 first: as
# a non-root caller, bwrap's own pid 1 ran as that uid without the sandbox's rlimits and with
# the stdin file open. Bounded whatever the sandbox does: one child, 256 MiB per hog, 3 s of
# sleep. The /proc/1/mem attack is the escape the review reproduced: it writes code over the
# instruction where pid 1 will resume (from /proc/1/syscall), then gives pid 1 an orphan to reap,
# so pid 1 execs a memory hog outside the sandbox's limits. That machine code is x86_64's, so
# elsewhere INJECT is False: an open of /proc/1/mem that succeeds is reported (and fails the
# test) without the code that would use it; every other check runs on every architecture.
PID1_ATTACKS = r"""
import ctypes, os, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.syscall.argtypes = [ctypes.c_long] * 6
libc.syscall.restype = ctypes.c_long
HOG = "b = bytearray(b'\\x01') * (256 << 20); print('HOG', len(b) >> 20, flush=True)"


def report(name, ret):
    print(name, 'ALLOWED' if ret >= 0 else f'errno {ctypes.get_errno()}', flush=True)


child = os.fork()
if child == 0:
    time.sleep(5)  # bounded
    os._exit(0)
report('ptrace pid 1', libc.ptrace(0x4206, 1, None, None))  # PTRACE_SEIZE
report('ptrace own child', libc.ptrace(0x4206, child, None, None))
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)  # one iovec, at the same address in both
report('process_vm_readv', libc.process_vm_readv(child, iov, 1, iov, 1, 0))
report('kcmp', libc.syscall(KCMP, os.getpid(), child, 0, 0, 0))  # KCMP_FILE: fd 0 of each
report('pidfd_getfd', libc.syscall(438, os.pidfd_open(child), 0, 0, 0, 0))
os.kill(child, 9)
os.waitpid(child, 0)
try:
    print('stdin via pid 1 READ', open('/proc/1/fd/0', 'rb').read(), flush=True)
except OSError as e:
    print('stdin via pid 1 errno', e.errno, flush=True)
try:
    with open('/proc/self/fd/0', 'r+b', buffering=0) as f:  # a fresh open of the host's file
        f.write(b'PWNED')
    print('stdin WRITTEN', flush=True)
except OSError as e:
    print('stdin write errno', e.errno, flush=True)
print('stdin', sys.stdin.read(), flush=True)
try:
    hog = bytearray(b'\x01') * (256 << 20)
    print('hog ALLOCATED', len(hog) >> 20, flush=True)
    del hog
except MemoryError:
    print('hog MemoryError', flush=True)
try:
    mem = open('/proc/1/mem', 'r+b', buffering=0)
except OSError as e:
    mem = None
    print('mem errno', e.errno, flush=True)
else:
    print('mem OPENED', flush=True)
if mem is not None and INJECT:
    pc = int(open('/proc/1/syscall').read().split()[-1], 16)  # where pid 1 resumes
    data, blob, addrs = pc + 64, b'', []
    for s in (sys.executable.encode(), b'-c', HOG.encode()):
        addrs.append(data + len(blob))
        blob += s + b'\0'
    blob += b'\0' * (-len(blob) % 8)
    argv = data + len(blob)
    blob += struct.pack('<4Q', *addrs, 0)
    code = (b'\x48\xbf' + struct.pack('<Q', addrs[0])  # mov rdi, path
            + b'\x48\xbe' + struct.pack('<Q', argv)  # mov rsi, argv
            + b'\x31\xd2\xb8\x3b\x00\x00\x00\x0f\x05'  # xor edx, edx; execve
            + b'\xbf\x2a\x00\x00\x00\xb8\x3c\x00\x00\x00\x0f\x05')  # exit(42)
    mem.seek(pc)
    mem.write(code.ljust(64, b'\x90') + blob)
    print('mem INJECTED', flush=True)
    if os.fork() == 0:  # an orphan for pid 1 to reap: its wait returns into the new code
        if os.fork() == 0:
            os._exit(0)
        os._exit(0)
    os.wait()
    time.sleep(3)  # bounded: time for pid 1's hog to print
"""


KCMP = {"x86_64": 312, "aarch64": 272}  # kcmp(2)'s number on the architectures tiller filters


def pid1_attacks(machine: str, inject: bool) -> str:
    """PID1_ATTACKS with kcmp's number on `machine` and, when `inject`, the x86_64 code that
    makes pid 1 exec the hog. Fails on an architecture tiller's seccomp filter does not know:
    ptrace and its relatives are not denied there."""
    if machine not in launch._SYSCALLS:
        pytest.fail(f"tiller's sandbox has no seccomp filter for {machine}: ptrace, "
                    "process_vm_readv/writev, kcmp and pidfd_getfd are not denied here")
    if machine not in KCMP:
        pytest.fail(f"add kcmp(2)'s syscall number on {machine} to KCMP")
    return f"KCMP, INJECT = {KCMP[machine]}, {inject}\n{PID1_ATTACKS}"


@pytest.mark.integration
def test_unprivileged_caller_cannot_escape_through_pid_1(unprivileged) -> None:
    """As a non-root caller, the sandbox's code shared a uid with bwrap's pid 1, which had the
    host's limits: ptrace and /proc/1/mem let it run a 256 MiB hog under memory_mb=64 (seen on
    the code before this test), and /proc/1/fd/0 gave the whole stdin file (the unit-test
    harness's nonce is on it). Now pid 1 is tiller's launcher: limited, not dumpable, its stdin
    closed; ptrace, process_vm_readv/writev, kcmp and pidfd_getfd are denied; stdin is a sealed
    memfd that no open can write. Off x86_64 the same, without the hog's machine code."""
    machine = platform.machine()
    outcome, stdout, stderr, left = _run_unprivileged(
        unprivileged, pid1_attacks(machine, inject=machine == "x86_64"), stdin="SECRET-STDIN",
        memory_mb=64, wall_seconds=10)
    assert "HOG" not in stdout and "ALLOWED" not in stdout and "INJECTED" not in stdout, stdout
    assert outcome == "ok", (stdout, stderr)
    assert stdout.splitlines() == [
        "ptrace pid 1 errno 1", "ptrace own child errno 1", "process_vm_readv errno 1",
        "kcmp errno 1", "pidfd_getfd errno 1",  # EPERM: seccomp
        "stdin via pid 1 errno 13", "stdin write errno 1", "stdin SECRET-STDIN",  # EACCES, EPERM
        "hog MemoryError", "mem errno 13",
    ]  # fmt: skip
    assert left == 0


# --- the fallback -----------------------------------------------------------------------------


def test_fallback_warns_and_runs_programs(fallback: Sandbox) -> None:
    assert fallback.backend == "subprocess"
    code = "import sys\nprint(sys.stdin.read(), open('d/f.txt').read())\nsys.exit(4)\n"
    r = fallback.run_python(code, stdin="in", files={"d/f.txt": "file"})
    assert (r.outcome, r.returncode, r.stdout, r.backend) == (
        SandboxOutcome.ERROR, 4, "in file\n", "subprocess"
    )  # fmt: skip


def test_fallback_enforces_cpu_and_wall_limits(fallback: Sandbox) -> None:
    r = fallback.run_python(BUSY_LOOP)
    assert r.outcome is SandboxOutcome.TIMEOUT, r
    assert r.returncode == -signal.SIGXCPU or r.wall_seconds >= LIMITS.wall_seconds, r
    token = _sleep_token()
    with pytest.warns(RuntimeWarning, match="WITHOUT bubblewrap"):
        quick = Sandbox(SandboxLimits(wall_seconds=1), backend="subprocess")
    code = f"import subprocess, time\nsubprocess.Popen(['sleep', {token!r}])\ntime.sleep(9)\n"
    r = quick.run_python(code)
    assert r.outcome is SandboxOutcome.TIMEOUT and r.wall_seconds < 9, r
    _assert_no_sleepers(token)  # its process group was killed


# A host process with a secret in its environment runs the same probe in both backends.
ENVIRON_HOST = """\
import warnings
from tiller.tools.sandbox import Sandbox
warnings.simplefilter('ignore')
probe = (
    "import glob\\n"
    "seen = []\\n"
    "for path in glob.glob('/proc/*/environ'):\\n"
    "    try:\\n"
    "        seen.append(b'TILLER_TEST_SECRET=' in open(path, 'rb').read())\\n"
    "    except OSError:\\n"
    "        pass\\n"
    "print(len(seen) > 0, any(seen))\\n"
)
for backend in ('subprocess', 'bwrap'):
    print(backend, Sandbox(backend=backend).run_python(probe).stdout.strip())
"""


@pytest.mark.integration
@needs_bwrap
def test_fallback_does_not_hide_the_trainers_environment() -> None:
    """What docs/sandbox.md says of the fallback's "cleared environment": the code's own is
    cleared, but it reads the trainer's through /proc/<ppid>/environ (same uid). bwrap's pid
    namespace shows it no host process."""
    env = {**os.environ, "PYTHONPATH": str(Path(sb.__file__).parents[2]),
           "TILLER_TEST_SECRET": secrets.token_hex(8)}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", ENVIRON_HOST], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["subprocess True True", "bwrap True False"]


@pytest.fixture
def fresh_probe(monkeypatch) -> None:
    """A process that has not probed bwrap yet, and has not been told to allow the fallback."""
    monkeypatch.setattr(sb, "_probe", sb._Probe())
    monkeypatch.setattr(sb, "_fallback_allowed", False)
    monkeypatch.setattr(sb, "PROBE_BACKOFF_S", 0.01)


def test_auto_refuses_to_run_unsandboxed_without_bwrap(monkeypatch, fresh_probe) -> None:
    """Without bwrap, `auto` used to fall back to an unsandboxed subprocess (as root, with
    network) after a warning; now it is a one-line ConfigError unless the fallback is allowed."""
    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError) as refused:
        Sandbox(LIMITS)
    msg = str(refused.value)
    assert "\n" not in msg
    assert "bubblewrap (bwrap) is not installed" in msg
    assert "env.tools.sandbox.allow_unsafe_fallback=true" in msg
    with pytest.warns(RuntimeWarning, match="bubblewrap .bwrap. is not installed"):
        box = Sandbox(LIMITS, allow_unsafe_fallback=True)
    assert box.run_python("print(1)").backend == "subprocess"
    sb.set_unsafe_fallback(True)  # what a run with the config knob set does
    for _ in range(2):  # each later Sandbox of the process warns again: never silent
        with pytest.warns(RuntimeWarning, match="WITHOUT bubblewrap"):
            assert Sandbox(LIMITS).backend == "subprocess"
    sb.set_unsafe_fallback(False)  # the reset: refused again
    with pytest.raises(ConfigError):
        Sandbox(LIMITS)
    with pytest.raises(RuntimeError, match="not installed"):
        Sandbox(backend="bwrap")


@needs_bwrap
def test_a_failed_probe_is_retried_counted_and_then_refused(monkeypatch, fresh_probe,
                                                            caplog) -> None:
    """A single failed bwrap test run used to switch the whole process to the unsandboxed
    fallback. Now it is retried; only PROBE_ATTEMPTS failures in a row refuse."""
    real_binds, broken_runs = launch._python_binds, [1]  # the first probe's bwrap fails to start

    def flaky_binds():
        if broken_runs:
            broken_runs.pop()
            missing = f"/nonexistent-{secrets.token_hex(4)}"
            return [(missing, missing)]
        return real_binds()

    monkeypatch.setattr(launch, "_python_binds", flaky_binds)
    assert Sandbox(LIMITS).backend == "bwrap"  # the retry worked
    assert sb.probe_failures() == 1 and "probe 1/3" in caplog.text

    monkeypatch.setattr(sb, "_probe", sb._Probe())
    broken_runs.extend([1] * sb.PROBE_ATTEMPTS)  # bwrap keeps failing
    with pytest.raises(ConfigError, match=r"bwrap failed a test run .*, 3 times"):
        Sandbox(LIMITS)
    assert sb.probe_failures() == 3
    with pytest.raises(ConfigError):  # the verdict holds; no silent fallback later
        Sandbox(LIMITS)


def test_code_env_refuses_to_start_without_the_sandbox(monkeypatch, fresh_probe,
                                                        tmp_path) -> None:
    """A run of the code env without bubblewrap stops at once with one line, unless
    env.tools.sandbox.allow_unsafe_fallback is set."""
    from helpers import TINY_ENV_RUN

    from tiller.config import load_config
    from tiller.controller import train
    from tiller.envs.code import CodeEnv

    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    cfg = load_config("configs/code.yaml", TINY_ENV_RUN)
    with pytest.raises(ConfigError, match="allow_unsafe_fallback=true") as refused:
        train(cfg, tmp_path)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "metrics.jsonl").exists() and not list(tmp_path.rglob("*.safetensors"))

    allowed = load_config("configs/code.yaml", ["env.tools.sandbox.allow_unsafe_fallback=true"])
    assert allowed.env.tools.sandbox.allow_unsafe_fallback is True
    sb.set_unsafe_fallback(allowed.env.tools.sandbox.allow_unsafe_fallback)  # as Run does
    with pytest.warns(RuntimeWarning, match="WITHOUT bubblewrap"):
        assert CodeEnv().sandbox.backend == "subprocess"
