"""Writing tiller's output files without writing through a link planted in a run folder.

A run folder may be shared or downloaded, so any name in it may be a symbolic link to a file
elsewhere (`report.html -> ~/.ssh/authorized_keys`). Every file or folder tiller writes whole
is written under a private temporary folder beside it (mode 0700: nobody else can put a link
in it) and then renamed over its name with `os.replace`: a link at the name is replaced, never
followed, and a reader never sees half a file. Files that are written in place (appended to,
or opened by SQLite or TensorBoard) are refused when their name is a link.

A folder inside the run folder may be a link too (`checkpoints -> /elsewhere`): every writer
takes the folder it writes below (`root`, the run folder) and refuses, in one line, a link
among the folders from there down to the file, so nothing is written or removed through one.

This does not defend against another user changing the folder while tiller writes to it:
keep run folders where only you can write (docs/security.md).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import stat
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from tiller.errors import ConfigError

logger = logging.getLogger(__name__)
# entries `remove_tree` could not remove, in this process ("entries"), each logged
REMOVE_FAILURES: Counter[str] = Counter()


def folder_below(root: str | Path, folder: str | Path, *, make: bool = True) -> Path:
    """`folder` (absolute), after a ConfigError naming the first folder below `root` on the
    way to it that is a symbolic link (`refuse_links`); with `make`, the missing ones (and
    `root`) are made. `root` is trusted as it is, links and all; `folder` must be inside it
    (a ValueError otherwise: a caller's mistake, not the user's)."""
    top, full = Path(os.path.abspath(root)), Path(os.path.abspath(folder))
    if full != top and top not in full.parents:
        raise ValueError(f"{str(folder)!r} is not inside {str(root)!r}")
    if make:
        top.mkdir(parents=True, exist_ok=True)
    for part in full.relative_to(top).parts:
        top = top / part
        refuse_links(top)
        if make:
            top.mkdir(exist_ok=True)
    return full


@contextmanager
def replacing(path: str | Path, *, root: str | Path) -> Iterator[Path]:
    """A fresh path to write `path`'s new content to (a file, or a folder such as a
    checkpoint), renamed over `path` when the block ends without an error (on an error `path`
    is left as it was). Whatever was at `path` (a file, a link, a folder) is replaced: a file
    or link in one rename; a folder over a folder in one exchange (`exchange`), so `path`
    holds the old folder or the new one at every moment and a kill leaves one of them there.
    Where the system cannot exchange (`exchange` says why) it takes two renames, the old
    folder aside and the new one in (rename(2) puts a folder only over a missing name or an
    empty folder): a kill between them leaves nothing at `path`, so each time is a warning.
    `root` is the folder written below (the run folder): a link among the folders between it
    and `path` is refused (`folder_below`)."""
    path = folder_below(root, Path(path).parent) / Path(path).name
    private = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        new = private / path.name
        yield new
        if new.is_dir() and path.is_dir() and not path.is_symlink():
            _folder_over_folder(new, path)  # the old one is left in `private`
        else:
            if new.is_dir() and (path.is_symlink() or path.exists()):
                path.unlink()  # a file or link: rename(2) puts a folder over no other entry
            os.replace(new, path)
    finally:
        remove_tree(private)


def _folder_over_folder(new: Path, path: Path) -> None:
    """The folder `new` put at `path`, where a folder is, the old folder left beside `new`:
    swapped in one `exchange`, or where there is none in two renames (a warning)."""
    why = exchange(new, path)
    if why is None:
        return  # the old folder is at `new` now
    logger.warning("%s is replaced in two renames (%s): a kill between them leaves nothing at "
                   "its name", path, why)
    os.replace(path, new.with_name(f"{path.name}.old"))
    os.replace(new, path)


RENAME_EXCHANGE = 2  # renameat2(2)'s flag, from <linux/fs.h>
AT_FDCWD = -100  # <fcntl.h>: a relative path is relative to the working directory
# what renameat2 answers where the kernel, the C library's caller or the file system has no
# exchange (ENOSYS: before Linux 3.15; EINVAL: a file system without it, e.g. NFS)
NO_EXCHANGE = frozenset({errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP})


def exchange(a: Path, b: Path) -> str | None:
    """Swap the entries at `a` and `b` (both existing, on one file system) in one
    renameat2(RENAME_EXCHANGE) (Linux 3.15 and glibc 2.28 or later; ext4, xfs, btrfs, tmpfs
    and overlayfs have it): None when done; why not, in a few words, when this system or file
    system has no exchange (nothing was changed). Any other error raises OSError."""
    if not sys.platform.startswith("linux"):
        return f"no renameat2 on {sys.platform}"
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "renameat2", None)
    if call is None:
        return "the C library has no renameat2"
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                     ctypes.c_uint]
    call.restype = ctypes.c_int
    if call(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return None
    err = ctypes.get_errno()
    if err in NO_EXCHANGE:
        return f"renameat2 RENAME_EXCHANGE: {errno.errorcode.get(err, err)}"
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def remove_tree(path: str | Path) -> int:
    """Remove the folder `path` and everything in it, going on past what cannot be removed:
    each such entry is logged (a warning with its path and the error) and counted in
    REMOVE_FAILURES. The number of failures (0: all removed)."""
    failures = 0

    def failed(_func: object, where: str, error: object) -> None:
        nonlocal failures
        error = error[1] if isinstance(error, tuple) else error  # onerror's exc_info
        failures += 1
        REMOVE_FAILURES["entries"] += 1
        logger.warning("could not remove %s: %s: %s", where, type(error).__name__, error)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=failed)
    else:
        shutil.rmtree(path, onerror=failed)
    return failures


def write_file(path: str | Path, data: str | bytes, *, root: str | Path) -> Path:
    """Write `data` (text as UTF-8) to `path` whole, by temporary file and rename (`replacing`
    below `root`)."""
    with replacing(path, root=root) as new:
        new.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def open_append(path: str | Path, *, root: str | Path) -> TextIO:
    """`path` opened to append UTF-8 text (created if missing); a link there, or among the
    folders between `root` and it, is refused."""
    path = folder_below(root, Path(path).parent) / Path(path).name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            refuse_links(path)
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


# in a run folder: flock'd by the `tiller train` process that runs it, for the run's life
RUN_LOCK = ".tiller.lock"


@contextmanager
def hold_run_dir(run_dir: str | Path) -> Iterator[None]:
    """An exclusive `flock` on `run_dir`'s RUN_LOCK (the folder and the empty file made if
    missing), held for the block: a second process that trains or resumes into the same run
    folder is refused in one line naming the holder's pid, before it reads or writes anything
    there (two processes would mix their records, and the later one's cut of metrics.jsonl
    would leave the other appending to a removed file). The kernel drops the lock when the
    process ends, however it ends (SIGKILL, OOM), so a dead run never blocks its resume. The
    file is never written: the holder's pid is read from /proc/locks."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_LOCK
    try:  # O_NONBLOCK: a FIFO planted there does not hang the open
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            refuse_links(path)
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path} is not a plain file: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"run folder {run_dir} is in use by another process "
                              f"({_lock_holder(fd)}, holding {path}): wait for it to end or "
                              "stop it; two runs in one folder would mix their records") from None
        yield
    finally:
        os.close(fd)  # the lock with it


def _lock_holder(fd: int) -> str:
    """"pid N" of the process holding a flock on `fd`'s file, from /proc/locks (lines like
    `1: FLOCK  ADVISORY  WRITE 2839 fe:00:1056 0 EOF`); "pid unknown" when it is not listed
    there (a process of another PID namespace shows as pid 0 or not at all)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "pid unknown"
    for line in lines:
        fields = line.split()
        if "FLOCK" in fields and "->" not in fields and key in fields:
            pid = fields[fields.index(key) - 1]
            if pid.isdigit() and pid != "0":
                return f"pid {pid}"
    return "pid unknown"


def refuse_links(*paths: str | Path) -> None:
    """One line when any of `paths` is a symbolic link: a file opened in place there would
    write wherever the link points."""
    for p in map(Path, paths):
        if p.is_symlink():
            raise ConfigError(f"{p} is a symbolic link (to {os.readlink(p)!r}); tiller does not "
                              "write through links: remove it, or write to another folder")


def refuse_sqlite_links(path: str | Path) -> None:
    """`refuse_links` for an SQLite database and the journal, WAL and shared-memory files
    SQLite opens beside it."""
    refuse_links(*(f"{path}{suffix}" for suffix in ("", "-journal", "-wal", "-shm")))
