"""CPU threads: how many threads each tiller process gives torch and the processes it starts.

This module is the one place that sets them (`runtime.threads` for `tiller train` and `tiller
eval`, `--threads` for `tiller serve`), once per process, when the model is loaded: before the
engine, the trainer or any episode does work. torch's intra-op count is per process and every
thread that computes (the engine's worker, the trainer, a judge model's worker) runs its own
team of that many threads, so the streams that run at once share the free cores. On a loaded
2-core machine two intra-op threads per stream cost more than they give (issue 19: the demo's
SFT took 120 s with 2 threads beside two busy processes, 78 s with 1); `benchmarks/threads.py`
measures it.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiller.errors import ConfigError

log = logging.getLogger(__name__)

# the variables the thread pools of a child process read at start-up: OpenMP (torch, numpy
# builds), MKL, OpenBLAS (numpy's default BLAS) and Rayon (Hugging Face tokenizers)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")
# below this many parameters an op's work is too small for a second thread to pay for its
# synchronization; the demo's model (0.5M parameters) gains from it on idle cores (issue 19:
# 29.1 s with 2 threads against 49.1 s with 1)
TINY_PARAMS = 250_000

_written: str | None = None  # the OMP_NUM_THREADS this module put in os.environ
_before: str | None = None  # OMP_NUM_THREADS as the environment had it until then


def default_threads(cores: int, load: float, params: int, streams: int) -> int:
    """The threads of each torch compute stream when nothing is set:

        free    = max(1, floor(cores - load + 1/2))   # cores no other process is using
        threads = max(1, free // streams)             # the streams that run at once share them
        threads = 1 when params < TINY_PARAMS         # too little work per op to split

    `cores`: the CPUs this process may use; `load`: the 1-minute load average (runnable
    processes, whoever they belong to); `streams`: this process's torch streams running at
    once (`tiller.run.compute_streams`)."""
    if params < TINY_PARAMS:
        return 1
    free = max(1, math.floor(cores - load + 0.5))
    return max(1, free // max(1, streams))


def _cgroup_cpus() -> float | None:
    """The CPU quota of this process's cgroup (v2 `cpu.max`) in CPUs, or None when unlimited
    or unreadable (e.g. `docker --cpus 2` sets one, while the affinity mask shows every host
    core)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        path = next(line[3:] for line in lines if line.startswith("0::"))
        quota, period = (Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max").read_text().split()
    except (OSError, StopIteration, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by its cgroup's CPU quota."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_cpus()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def _inherited_threads() -> int | None:
    """OMP_NUM_THREADS as the user's environment set it (not as this module wrote it: then
    what was there before)."""
    value = os.environ.get("OMP_NUM_THREADS")
    value = (_before if _written is not None and value == _written else value) or ""
    value = value.strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"environment variable OMP_NUM_THREADS={value!r}: expected a whole "
                          "number of threads, at least 1 (runtime.threads auto takes it); unset "
                          "it or set runtime.threads")
    return int(value)


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    source: str  # the setting ("runtime.threads", "--threads"), "OMP_NUM_THREADS" or "auto"
    rule: dict[str, float] | None = None  # auto: the rule's inputs


def choose_threads(setting: int | str, *, params: int, streams: int,
                   field: str = "runtime.threads") -> ThreadChoice:
    """`setting` (a number, or "auto") resolved: the number itself, else the environment's
    OMP_NUM_THREADS, else `default_threads` on this machine now."""
    if setting != "auto":
        return ThreadChoice(int(setting), field)
    inherited = _inherited_threads()
    if inherited is not None:
        return ThreadChoice(inherited, "OMP_NUM_THREADS")
    cores, load = usable_cores(), os.getloadavg()[0]
    return ThreadChoice(default_threads(cores, load, params, streams), "auto",
                        {"usable_cores": cores, "load_1min": load, "streams": streams,
                         "parameters": params})


def thread_env(threads: int) -> dict[str, str]:
    """The environment that gives a child process's thread pools `threads` threads each."""
    return dict.fromkeys(THREAD_VARS, str(threads))


def apply_threads(threads: int) -> dict[str, Any]:
    """Set this process's torch threads (intra-op always; inter-op where torch still allows
    it: once per process, before any inter-op work) and the thread variables its children
    inherit. Returns what torch reports afterwards."""
    import torch  # here, so the config (which validates runtime.threads) stays torch-free

    global _written, _before
    torch.set_num_threads(threads)
    interop = torch.get_num_interop_threads()
    if interop != threads:
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # set already, or its pool has started
            log.info("torch inter-op threads stay %d: torch sets them once per process",
                     interop)
    env = thread_env(threads)
    if _written is None or os.environ.get("OMP_NUM_THREADS") != _written:
        _before = os.environ.get("OMP_NUM_THREADS")  # the user's (or a later change of it)
    os.environ.update(env)
    _written = env["OMP_NUM_THREADS"]
    return {"torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(), "child_env": env}


def set_up_threads(setting: int | str, *, params: int, streams: int,
                   field: str = "runtime.threads") -> dict[str, Any]:
    """Choose, apply and log this process's threads; the record a run keeps (runtime.json)."""
    choice = choose_threads(setting, params=params, streams=streams, field=field)
    record = {"threads": choice.threads, "source": choice.source, "rule": choice.rule,
              **apply_threads(choice.threads)}
    why = choice.source
    if choice.rule is not None:
        r = choice.rule
        why = (f"auto: {r['usable_cores']} usable cores, 1-min load {r['load_1min']:.2f}, "
               f"{r['streams']} compute stream(s), {r['parameters']:,} parameters")
    log.info("tiller threads: %d torch thread(s) per compute stream (%s); child processes get "
             "OMP_NUM_THREADS=%d", choice.threads, why, choice.threads)
    cores = usable_cores()
    if choice.rule is None and choice.threads * streams > cores:  # asked for, not the rule
        log.warning("%s: %d thread(s) x %d compute stream(s) is more than the %d cores this "
                    "process may use: the threads will wait for each other", choice.source,
                    choice.threads, streams, cores)
    return record
