"""The server side of `engine.weight_transfer: shm`: a vLLM weight-transfer engine that loads a
full update from the shared-memory segment the trainer wrote (`vllm_shm`), imported only
inside a vLLM server (it imports vLLM).

vLLM loads every `vllm.general_plugins` entry point in each of its processes
(`vllm/plugins/__init__.py`, `load_general_plugins`); tiller's (pyproject.toml) is `register`,
which adds `TillerShmWeightTransferEngine` to `WeightTransferEngineFactory` as `tiller_shm`.
A server started with `--weight-transfer-config '{"backend": "tiller_shm"}'` then creates it
in its worker (`Worker.load_model`, which vLLM's `CPUWorker` inherits) and drives it from
`/start_weight_update`, `/update_weights` and `/finish_weight_update`.

One `/update_weights` call carries the whole update. Nothing touches the model before the
segment is checked against its manifest (`vllm_shm.read_manifest`: entries bounded, the file
a regular file of tiller's in /dev/shm of exactly the manifest's size, every tensor inside
it), so a missing or truncated segment is an error and the served weights stay the old ones.
The mapping is kept for the next update of the same file (`_segment`). Then, as vLLM's own
reload from disk does (`model_loader/reload/inplace.py`): layerwise reload
initialised, `model.load_weights` over views of the mapped file, finalised.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from tiller.engine.vllm_shm import BACKEND, DTYPES, Entry, checked_segment


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """No rendezvous: the segment's path comes with each update."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """The `/update_weights` info as sent (checked by `read_manifest` before use)."""

    info: dict[str, Any]


class TillerShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Loads a full update from a shared-memory segment (module docstring)."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False
    # the last update's segment: ((device, inode, size), its mapping), kept for the next one
    _mapped: tuple[tuple[int, int, int], torch.Tensor] | None = None

    def parse_update_info(self, update_dict: dict[str, Any]) -> ShmUpdateInfo:
        return ShmUpdateInfo(info=update_dict)

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        """Nothing to set up."""

    def start_weight_update(self) -> None:
        """Nothing before the segment is checked (`receive_weights` does the reload)."""

    def finish_weight_update(self) -> None:
        """`receive_weights` finished the reload."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one update. The base class's `torch.accelerator.synchronize()` raises on a
        machine without an accelerator, so only a device other than the CPU is synchronized."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        fd, entries, size = checked_segment(update_info.info)
        try:
            segment = self._segment(fd, size)
        finally:
            os.close(fd)  # the mapping holds its own reference
        initialize_layerwise_reload(self.model)
        with disable_mtp_completeness_check():
            self.model.load_weights(views(segment, entries))
        finalize_layerwise_reload(self.model, self.model_config)

    def _segment(self, fd: int, size: int) -> torch.Tensor:
        """The open segment `fd` of `size` bytes, mapped: the mapping of the last update when
        it is of the same file (device and inode: the trainer writes each push into the
        segment it wrote the last one into) and size, else a new one, kept in its place
        (populating a fresh mapping of 540 MB took 0.06-0.1 s of a push, SmolLM2-135M fp32;
        docs/engines.md). The kept mapping holds the file's pages until the next update of
        another file or `shutdown`, also after the trainer removed it."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, size)
        if self._mapped is None or self._mapped[0] != key:
            self._mapped = None  # the old file's pages go before the new ones are mapped
            self._mapped = (key, mapped(fd, size))
        return self._mapped[1]

    def shutdown(self) -> None:
        """Drop the kept mapping."""
        self._mapped = None


def mapped(fd: int, size: int) -> torch.Tensor:
    """The first `size` bytes of the open file `fd`, mapped read-only (a write would fault;
    unmapped when the tensor and its views are freed). Read-only rather than
    `torch.from_file(shared=False)`, which took 0.18-0.39 s against 0.14 s to copy 540 MB out
    of /dev/shm here."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    # populated at once: faulting in each page of a fresh tmpfs file took 0.31 s of
    # copying 540 MB out, against 0.09 s populated
    view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # "non-writable buffer": read-only on purpose
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def views(segment: torch.Tensor, entries: list[Entry]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each entry: a view of the mapped `segment`, no copy."""
    for e in entries:
        raw = segment[e.offset:e.offset + e.nbytes]
        yield e.name, raw.view(DTYPES[e.dtype]).view(e.shape)


def register() -> None:
    """The `vllm.general_plugins` entry point: `tiller_shm` in vLLM's factory (vLLM may call
    it more than once in one process; it registers once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, TillerShmWeightTransferEngine)
