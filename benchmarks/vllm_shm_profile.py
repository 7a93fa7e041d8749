"""Where the vLLM side of a `tiller_shm` push goes: the `TillerShmWeightTransferEngine` of an
in-process vLLM CPU engine (`vllm.LLM`, engine core in this process) loads a segment of the
model's own weights --repeats times; per load, its total seconds, the segment's mapping
(`vllm_shm_server.mapped`, the first load only since the mapping is kept) and vLLM's CPU GEMM
weight packing in `process_weights_after_loading` (`dispatch_cpu_unquantized_gemm`, of which
`create_onednn_mm`: oneDNN's packed copy of each linear layer's weight, made anew at every
reload). Medians over the loads after the first. Runs in vLLM's environment:

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_shm_profile.py \\
        /work/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402
import vllm.model_executor.layers.utils as layer_utils  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from vllm import LLM  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from tiller.engine import vllm_shm_server  # noqa: E402
from tiller.engine.vllm_shm import BACKEND, remove_segment, write_segment  # noqa: E402

PARTS: dict[str, float] = {}


def timed(module: Any, name: str, part: str) -> None:
    """Add the seconds of every call of `module.name` to PARTS[part]."""
    fn: Callable[..., Any] = getattr(module, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PARTS[part] = PARTS.get(part, 0.0) + time.perf_counter() - start
    setattr(module, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a saved HF model folder")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    timed(ops, "create_onednn_mm", "onednn_pack")
    timed(layer_utils, "dispatch_cpu_unquantized_gemm", "gemm_dispatch")
    timed(vllm_shm_server, "mapped", "map")
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, enable_chunked_prefill=False,
              weight_transfer_config={"backend": BACKEND})
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    engine = worker.weight_transfer_engine
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    info = write_segment({k: v.detach() for k, v in model.state_dict().items()})
    rows = []
    try:
        for _ in range(args.repeats):
            PARTS.clear()
            start = time.perf_counter()
            engine.receive_weights(vllm_shm_server.ShmUpdateInfo(info=info))
            rows.append({"load": time.perf_counter() - start, **PARTS})
    finally:
        remove_segment(info["path"])
    keys = ["load", "map", "gemm_dispatch", "onednn_pack"]
    print("| load | " + " | ".join(f"{k} s" for k in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for i, r in enumerate(rows):
        print(f"| {i + 1} | " + " | ".join(f"{r.get(k, 0.0):.3f}" for k in keys) + " |")
    med = {k: statistics.median(r.get(k, 0.0) for r in rows[1:]) for k in keys}
    print("| median (2nd on) | " + " | ".join(f"{med[k]:.3f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
