"""Weight pushes into vLLM through one shared-memory segment (`engine.weight_transfer: shm`).

The trainer writes every tensor of a full update into one file on tmpfs (`/dev/shm`, pages in
RAM: no disk, no safetensors header) at 64-byte-aligned offsets, and sends vLLM the segment's
path and size and a manifest (name, dtype, shape, offset per tensor) through vLLM's
weight-transfer API (`/start_weight_update`, `/update_weights`, `/finish_weight_update`). The
server-side engine (`vllm_shm_server.TillerShmWeightTransferEngine`, registered with vLLM's
`WeightTransferEngineFactory` as `tiller_shm` by a `vllm.general_plugins` entry point) checks
the manifest against the segment with `read_manifest`, maps the file and loads the tensors
through the model's `load_weights`. The trainer writes the next push into the same segment,
which it keeps mapped (tmpfs pages already allocated: writing into a fresh file took as long as
safetensors to disk; mapping the kept file anew each push took as long as the copy), and the
server keeps its read-only mapping of it too (`vllm_shm_server`). The trainer removes it when
a push fails or is interrupted and when the engine closes (`write_segment` / `remove_segment`).

This module imports no vLLM: the trainer uses it, and so does the server-side engine.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiller.engine.servers import run_in_group
from tiller.errors import RunError

BACKEND = "tiller_shm"  # the name in vLLM's factory and in --weight-transfer-config
ENTRY_POINT = "tiller.engine.vllm_shm_server:register"  # pyproject.toml's vllm.general_plugins
SHM_DIR = Path("/dev/shm")
PLUGIN_CHECK_S = 60.0  # seconds `plugin_installed` may take
PLUGIN_MISSING = 3  # `plugin_installed`'s probe's exit when the entry point is not there
PREFIX = "tiller-weights-"  # + the trainer's pid + "-" + a random part
ALIGN = 64  # bytes; every tensor starts at a multiple of it (any dtype view is aligned)
MAX_TENSORS = 100_000  # manifest entries the server reads at most
MAX_NAME = 512  # characters of one tensor name
MAX_NDIM = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Entry:
    """One tensor of a segment: `nbytes` bytes at `offset`, viewed as `dtype` of `shape`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * DTYPES[self.dtype].itemsize


def unfit_dtypes(tensors: dict[str, torch.Tensor]) -> list[str]:
    """'name (dtype)' of each tensor a segment cannot carry (not one of `DTYPES`)."""
    return [f"{n} ({str(t.dtype).removeprefix('torch.')})" for n, t in tensors.items()
            if str(t.dtype).removeprefix("torch.") not in DTYPES]


def layout(tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], int]:
    """The entries of `tensors` in order, each at the next multiple of `ALIGN`, and the
    segment's size: offset_i = ceil((offset_{i-1} + nbytes_{i-1}) / ALIGN) * ALIGN."""
    entries, end = [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {dtype} cannot go through shared memory "
                             f"(one of {', '.join(DTYPES)})")
        offset = -(-end // ALIGN) * ALIGN
        entries.append(Entry(name, dtype, tuple(t.shape), offset))
        end = offset + entries[-1].nbytes
    return entries, end


def write_segment(tensors: dict[str, torch.Tensor], folder: Path = SHM_DIR,
                  reuse: str | None = None) -> dict[str, Any]:
    """Write `tensors` into the segment at `reuse` (the last push's: its pages are allocated
    and, in this process, still mapped (`_mapping`), so the write is one copy per tensor) or a
    new file of `folder` (mode 0600, a name no other process holds, `tiller-weights-<this
    pid>-*`) and return the `/update_weights` info: {"path", "size", "names", "dtypes",
    "shapes", "offsets"}. The file is removed when the write fails (e.g. tmpfs full: its space
    is reserved before anything is copied, so that is an OSError, not a SIGBUS of a store into
    the mapping); a `reuse` file that is gone raises FileNotFoundError."""
    entries, size = layout(tensors)
    if reuse is not None:
        try:
            fd, path = os.open(reuse, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC), reuse
        except FileNotFoundError:  # removed under the run: its mapping goes too
            _MAPPED.pop(reuse, None)
            raise
    else:
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=folder)
    try:
        try:
            data = _mapping(path, fd, size)
        finally:
            os.close(fd)  # the mapping holds the file
        for e, t in zip(entries, tensors.values(), strict=True):
            # .cpu(): a no-op for the CPU trainer; a CUDA one's tensors are copied out
            data[e.offset:e.offset + e.nbytes].copy_(
                t.detach().contiguous().view(-1).view(torch.uint8).cpu())
    except BaseException:
        remove_segment(path)
        raise
    return {"path": path, "size": size, "names": [e.name for e in entries],
            "dtypes": [e.dtype for e in entries], "shapes": [list(e.shape) for e in entries],
            "offsets": [e.offset for e in entries]}


@dataclass
class _Mapped:
    """A segment this process wrote, mapped writable: the file (`dev`, `ino`) and its `size`."""

    dev: int
    ino: int
    size: int
    data: torch.Tensor  # uint8, over the mapping (unmapped once this and its views are freed)


# the segments this process writes pushes into, by path, kept mapped from one push to the next:
# mapping a 540 MB segment anew each push took about as long as the copy itself (0.16 s against
# 0.08 s for the copy into a kept mapping, SmolLM2-135M fp32; docs/engines.md, "Weight sync")
_MAPPED: dict[str, _Mapped] = {}


def _mapping(path: str, fd: int, size: int) -> torch.Tensor:
    """The bytes of the segment `path` (open as `fd`), `size` long, mapped writable: the kept
    mapping when it is of this file at this size, else the file is sized (its tmpfs space
    reserved: ENOSPC here, not at a store) and mapped anew, and kept."""
    st = os.fstat(fd)
    kept = _MAPPED.get(path)
    if kept is not None and (kept.dev, kept.ino, kept.size) == (st.st_dev, st.st_ino, size) \
            and st.st_size == size:
        return kept.data
    _MAPPED.pop(path, None)
    if st.st_size != size:
        os.ftruncate(fd, size)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    os.posix_fallocate(fd, 0, size)
    view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = torch.frombuffer(view, dtype=torch.uint8)
    _MAPPED[path] = _Mapped(st.st_dev, st.st_ino, size, data)
    return data


def plugin_installed(python: str, env: dict[str, str], timeout_s: float | None = None) -> bool:
    """Whether `python` (run with `env`) sees tiller's `vllm.general_plugins` entry point, which
    registers `BACKEND` in vLLM's factory (scripts/setup.sh installs it); without it a server
    started with `BACKEND` fails at start-up with vLLM's "Invalid weight transfer backend".
    Asked within min(`PLUGIN_CHECK_S`, `timeout_s`) seconds, in a process group of its own
    killed whole when it ends (`servers.run_in_group`). Not installed only when the probe says
    so (`PLUGIN_MISSING`); a probe that fails otherwise (a broken environment, killed) is a
    RunError with its exit and the last line of its stderr, as is one that runs out of time."""
    bound = PLUGIN_CHECK_S if timeout_s is None else min(PLUGIN_CHECK_S, timeout_s)
    code = ("import sys; from importlib.metadata import entry_points as e; sys.exit(0 if any("
            f"p.name == {BACKEND!r} and p.value == {ENTRY_POINT!r} "
            f"for p in e(group='vllm.general_plugins')) else {PLUGIN_MISSING})")
    exit_code, _, err = run_in_group([python, "-c", code], env, bound)
    what = f"engine.weight_transfer: shm: checking {python}'s environment for tiller's vLLM plugin"
    if exit_code is None:
        raise RunError(f"{what} took more than {bound:g} s")
    if exit_code not in (0, PLUGIN_MISSING):
        how = f"killed by signal {-exit_code}" if exit_code < 0 else f"exit {exit_code}"
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise RunError(f"{what} failed ({how}): {last}")
    return exit_code == 0


def remove_segment(path: str) -> None:
    """Remove the segment at `path` (gone already is fine) and drop this process's mapping of
    it."""
    _MAPPED.pop(path, None)
    Path(path).unlink(missing_ok=True)


def remove_stale_segments(folder: Path = SHM_DIR) -> list[str]:
    """Remove this user's segments `tiller-weights-<pid>-*` of `folder` whose trainer `pid` no
    longer runs (a trainer killed by SIGKILL or the OOM killer cannot remove its own; tmpfs
    holds them in RAM until reboot) and return their names. Segments of running processes, of
    other users and names without a pid are left."""
    removed = []
    for p in sorted(folder.glob(f"{PREFIX}*")):
        pid = p.name.removeprefix(PREFIX).split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # running, another user's
        try:
            if p.lstat().st_uid != os.getuid():
                continue
            p.unlink()
        except FileNotFoundError:
            continue  # removed meanwhile
        removed.append(p.name)
    return removed


def checked_segment(info: Any, folder: Path = SHM_DIR) -> tuple[int, list[Entry], int]:
    """An open read-only descriptor of the segment an `/update_weights` info names, its entries
    and size after `read_manifest`: the path must name a regular file `tiller-weights-*`
    directly in `folder`, not a link (opened with O_NOFOLLOW, checked on the open file), owned
    by this process's user (another local user's file would load their weights). Else one
    ValueError line. The caller closes the descriptor."""
    path = info.get("path") if isinstance(info, dict) else None
    if not (isinstance(path, str) and os.path.dirname(path) == str(folder)
            and os.path.basename(path).startswith(PREFIX)):
        raise ValueError(f"tiller shm segment: path {str(path)[:200]!r} is not a "
                         f"{folder}/{PREFIX}* file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        what = "a symbolic link, refused" if e.errno == errno.ELOOP else \
            f"{type(e).__name__}: {e}"
        raise ValueError(f"tiller shm segment {path}: {what}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"tiller shm segment {path}: not a regular file")
        if st.st_uid != os.getuid():
            raise ValueError(f"tiller shm segment {path}: owned by uid {st.st_uid}, not this "
                             f"server's user ({os.getuid()}), refused")
        return fd, read_manifest(info, st.st_size), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_manifest(info: dict[str, Any], file_size: int) -> list[Entry]:
    """The entries of an `/update_weights` info checked against the segment's `file_size`,
    before anything is loaded: at most `MAX_TENSORS` entries, the lists of equal length, names
    of at most `MAX_NAME` characters, known dtypes, shapes of at most `MAX_NDIM` non-negative
    ints, aligned offsets, each tensor inside `size`, and `size` the file's size (a truncated
    or grown segment is refused). Else one ValueError line."""
    keys = ("path", "size", "names", "dtypes", "shapes", "offsets")
    if not isinstance(info, dict) or set(info) != set(keys):
        got = sorted(info) if isinstance(info, dict) else type(info).__name__
        raise ValueError(f"tiller shm update info: expected keys {list(keys)}, got {got}")
    size, names = info["size"], info["names"]
    if not isinstance(names, list) or len(names) > MAX_TENSORS:
        raise ValueError(f"tiller shm manifest: names must be a list of at most {MAX_TENSORS}")
    if any(not isinstance(info[k], list) or len(info[k]) != len(names) for k in keys[3:]):
        raise ValueError("tiller shm manifest: names, dtypes, shapes and offsets differ in "
                         "length")
    if not _is_int(size) or size != file_size:
        raise ValueError(f"tiller shm segment {info['path']}: {file_size} bytes, the manifest "
                         f"says {size}")
    entries = []
    for name, dtype, shape, offset in zip(names, info["dtypes"], info["shapes"],
                                          info["offsets"], strict=True):
        ok = (isinstance(name, str) and 0 < len(name) <= MAX_NAME and dtype in DTYPES
              and isinstance(shape, list) and len(shape) <= MAX_NDIM
              and all(_is_int(d) and d >= 0 for d in shape)
              and _is_int(offset) and offset >= 0 and offset % ALIGN == 0)
        if not ok:
            raise ValueError(f"tiller shm manifest: bad entry {str(name)[:80]!r} (dtype "
                             f"{str(dtype)[:20]}, shape {str(shape)[:40]}, offset "
                             f"{str(offset)[:20]})")
        entry = Entry(name, dtype, tuple(shape), offset)
        if offset + entry.nbytes > size:
            raise ValueError(f"tiller shm manifest: {name} ends at byte "
                             f"{offset + entry.nbytes}, past the segment's {size}")
        entries.append(entry)
    return entries


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
