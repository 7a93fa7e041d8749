"""What a checkpoint takes from each trainer process besides the weights: its generators'
states (`rng_state`, `set_rng_state`), and the checkpoint writes' test hook (`pause`). Here,
below `tiller.checkpoints`, so that trainer ranks (`train.distributed`) use them too."""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

# Test hook (tests/test_resume.py), not a setting: "PHASE:SECONDS" makes each checkpoint write
# (or RL step) sleep SECONDS at PHASE, saying so on stderr, so a test can SIGKILL the run (or a
# trainer rank) there. The phases: "train" (an RL step's batch shaped, its optimizer step not
# taken yet: `controller.rl`); those of a checkpoint write, in order: "ranks"
# (train.world_size > 1: the model written, rank 0 about to join the gather of the ranks'
# optimizer and RNG states, the other ranks in it: `train.distributed`), "files" (the weights
# and tensors written, state.json not yet), "marker" (everything but the marker written),
# "rename" (the folder whole and fsynced, not yet renamed into place), "remove" (an old
# checkpoint past checkpoint.keep renamed aside, not yet removed).
PAUSE_ENV = "TILLER_TEST_CHECKPOINT_PAUSE"
PAUSES = ("train", "ranks", "files", "marker", "rename", "remove")

def pause(phase: str) -> None:
    """The test hook's sleep at `phase` (PAUSE_ENV); a value it cannot read stops loudly."""
    value = os.environ.get(PAUSE_ENV, "")
    if not value:
        return
    at, _, seconds = value.partition(":")
    if at not in PAUSES:
        raise ValueError(f"{PAUSE_ENV}={value!r}: PHASE:SECONDS, PHASE one of {PAUSES}")
    if at == phase:
        print(f"{PAUSE_ENV}: {seconds} s at {phase}", file=sys.stderr, flush=True)
        time.sleep(float(seconds))


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Python's and numpy's generator states (JSON) and torch's (tensors)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    py = {"python": [version, list(internal), gauss],
          "numpy": [name, keys.tolist(), pos, has_gauss, cached]}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return py, tensors


def _python_state(py: dict[str, Any]) -> tuple[Any, ...]:
    version, internal, gauss = py["python"]
    return version, tuple(internal), gauss


def _numpy_state(py: dict[str, Any]) -> tuple[Any, ...]:
    name, keys, pos, has_gauss, cached = py["numpy"]
    return name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached


def check_rng_state(py: dict[str, Any]) -> None:
    """`py` (Python's and numpy's states as `rng_state` gives them, read back from JSON) put
    into throwaway generators: a KeyError, TypeError, ValueError, IndexError or OverflowError
    when it is not of that shape, and this process's generators untouched."""
    random.Random().setstate(_python_state(py))
    np.random.RandomState().set_state(_numpy_state(py))


def set_rng_state(py: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """`rng_state`'s states put back into this process's generators. The CUDA generators are
    put back device by device, as many as both this machine and the checkpoint have; when
    their counts differ (a CPU checkpoint resumed on CUDA, or the other way, or another number
    of GPUs) a warning says so in one line: the generators without a state keep their own, so
    what draws from them is not the checkpointed run's."""
    random.setstate(_python_state(py))
    np.random.set_state(_numpy_state(py))
    torch.set_rng_state(tensors["torch"])
    saved = sum(1 for k in tensors if k.startswith("cuda"))
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved != here:
        log.warning("--resume: the checkpoint holds the RNG states of %d CUDA devices, this "
                    "process sees %d: the CUDA generators of the first %d are put back, the "
                    "rest keep their own (what draws from them is not the checkpointed run's)",
                    saved, here, min(saved, here))
    cuda = [tensors[f"cuda{i}"] for i in range(here) if f"cuda{i}" in tensors]
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def add_rank_states(py: dict[str, Any], tensors: dict[str, torch.Tensor],
                    ranks: list[tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> None:
    """Every other trainer rank's states (`ranks[r]`, rank 0's being this process's, already in
    `py` and `tensors`) added to them: `py["ranks"]` in rank order, tensors as `rank<r>/<k>`."""
    py["ranks"] = [rank_py for rank_py, _ in ranks[1:]]
    tensors.update({f"rank{r}/{k}": t for r, (_, rank_tensors) in enumerate(ranks) if r
                    for k, t in rank_tensors.items()})


def rank_states(py: dict[str, Any], tensors: dict[str, torch.Tensor]
                ) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]] | None]:
    """`add_rank_states`'s ranks read back: None for rank 0 (this process's, put back with the
    run's), then each other rank's (python/numpy, tensors)."""
    return [None, *((rank_py, {k.split("/", 1)[1]: t for k, t in tensors.items()
                               if k.startswith(f"rank{r}/")})
                    for r, rank_py in enumerate(py["ranks"], start=1))]
