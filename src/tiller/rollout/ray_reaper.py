"""The guard of a run's local Ray instance: nothing of it outlives the run's process, however
that process ends (SIGKILL included).

Ray kills its GCS and raylet when the process that started them dies (they are fate-shared with
it) and the actors with the raylet, but its dashboard and runtime-env agents wait up to 60 s on
the dead GCS first (`publish_error_to_driver`'s timeout in Ray 2.60), and the instance's
temporary folder stays. So `RayCluster` starts this process before the instance, with a pipe
on its stdin, and marks every process of the instance with `INSTANCE_ENV` (set in the run's
process around `ray.init`: the processes Ray starts, and the workers its raylet starts,
inherit it). The guard reads the pipe; at its end (the run's process closed it after an
orderly `ray.shutdown`, or died), it SIGKILLs every process of this user marked with this
instance's folder, waits until they are gone (`REAP_TIMEOUT_S`), removes the folder, and
when it killed any, appends one line saying so to the log file it was given (the run
folder's `ray_reaper.log`) and exits with status 1 (else 0).

Run as `python -I PATH/ray_reaper.py TEMP_DIR LOG_FILE` (a file, isolated: it imports only
the standard library, so it starts at once). Linux: it reads /proc.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

INSTANCE_ENV = "TILLER_RAY_INSTANCE"
REAP_TIMEOUT_S = 10.0  # the killed processes gone by then (SIGKILL: they cannot refuse it)


def marked(temp_dir: str) -> list[int]:
    """This user's processes (this one excepted) whose environment says they belong to the
    instance of `temp_dir`."""
    want = f"{INSTANCE_ENV}={temp_dir}".encode()
    uid, out = os.getuid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            if want in (entry / "environ").read_bytes().split(b"\0"):
                out.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return out


def reap(temp_dir: str) -> tuple[list[int], list[int]]:
    """SIGKILL the instance's processes; (those killed, those still there at the timeout)."""
    killed = marked(temp_dir)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + REAP_TIMEOUT_S
    left = marked(temp_dir)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in marked(temp_dir) if _alive(pid)]
    return killed, left


def _alive(pid: int) -> bool:
    """Not gone and not a zombie (a killed child of a dead parent waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main(temp_dir: str, log_file: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the run's to handle, then ours
    sys.stdin.buffer.read()  # until the run's process closes the pipe or dies
    killed, left = reap(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)
    if not killed and not left:  # an orderly shutdown left nothing
        return 0
    line = (f"{time.strftime('%Y-%m-%dT%H:%M:%S')} Ray instance {temp_dir}: the run's process "
            f"ended; {len(killed)} of its processes left were killed {killed}"
            f"{f', {len(left)} still there after {REAP_TIMEOUT_S:g}s {left}' if left else ''}"
            f"; its folder removed\n")
    with open(log_file, "a") as f:
        f.write(line)
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
