"""Weight sync into a managed vLLM CPU server: seconds of a full update through a folder on disk
(the run folder), a folder on tmpfs (/dev/shm), and one /dev/shm segment loaded by tiller's
`tiller_shm` weight-transfer engine (`engine.weight_transfer: shm`), against a plain
`save_pretrained` of the same model to disk, all into one server started with both. Each push
is `VllmEngine.update_weights`: the shape and finiteness check, the write (`save`), then on the
server /pause, the load (/collective_rpc reload_weights, or /start_weight_update,
/update_weights, /finish_weight_update), /reset_prefix_cache and /resume (`reload`). Medians
of --repeats; the parity of the last push is printed too.

    bash scripts/setup.sh      # .venv-vllm
    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_sync.py

The model: a Qwen3 built by `tiller.models.build_tiny_model` with --hidden/--layers/--heads
(default 512/8/8, head_dim 64: 25.7M parameters with the 1024-token tokenizer), fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiller.config import VllmEngineConfig
from tiller.engine.updates import WeightUpdate
from tiller.engine.vllm import VllmEngine, connect_vllm
from tiller.models import build_tiny_model

CORPUS = ["the calculator adds 1 + 2 = 3 and <tool_call> answers </tool_call>"] * 200


def timed(fn) -> float:  # noqa: ANN001 - any callable
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class CallTimes:
    """Seconds of each part of the pushes of `engine` since the last `take`: its `_save` (the
    checks and the write, as "save") and each HTTP call by path (query dropped), summed per
    push."""

    def __init__(self, engine: VllmEngine):
        self.calls: dict[str, float] = {}
        post, save = engine._post, engine._save

        async def timed_post(server: Any, path: str, *a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return await post(server, path, *a, **k)
            finally:
                self._add(path.split("?")[0], time.perf_counter() - start)

        def timed_save(*a: Any, **k: Any) -> None:
            start = time.perf_counter()
            try:
                save(*a, **k)
            finally:
                self._add("save", time.perf_counter() - start)

        engine._post, engine._save = timed_post, timed_save  # type: ignore[method-assign]

    def _add(self, key: str, s: float) -> None:
        self.calls[key] = self.calls.get(key, 0.0) + s

    def take(self) -> dict[str, float]:
        calls, self.calls = self.calls, {}
        return calls


def push_times(engine: VllmEngine, model: torch.nn.Module, folder: Path, first: int,
               repeats: int, transfer: str = "disk", calls: CallTimes | None = None
               ) -> tuple[list[float], list[float], list[dict[str, float]]]:
    """(total, write, parts) of `repeats` full pushes through `folder` (`transfer` disk) or a
    /dev/shm segment (shm; the server must run tiller's `tiller_shm` engine): seconds of each
    push, of a write of the same update before it, and of the push's parts (`calls`, when
    given: a `CallTimes` of `engine`)."""
    engine.weights_dir, engine.root, engine.transfer = folder, folder, transfer
    totals, writes, parts = [], [], []
    for i in range(repeats):
        update = WeightUpdate(first + i, {k: v.detach() for k, v in model.state_dict().items()})
        # shm: the push writes into the segment this timed write left, as in a run
        writes.append(timed(lambda u=update: engine._save(u, folder / "probe")))
        if calls is not None:
            calls.take()
        totals.append(timed(lambda u=update: engine.update_weights(u)))
        parts.append(calls.take() if calls is not None else {})
    return totals, writes, parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/tiller-vllm-sync")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    work = Path(args.work)
    path = work / f"model-{args.hidden}-{args.layers}-{args.heads}"
    if not path.exists():
        build_tiny_model(path, CORPUS, vocab_size=1024, hidden_size=args.hidden,
                         num_layers=args.layers, num_heads=args.heads, max_positions=512)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    hf = [timed(lambda: model.save_pretrained(work / "hf")) for _ in range(args.repeats)]
    engine = connect_vllm(VllmEngineConfig(kv_cache_bytes=64 << 20, weight_transfer="shm"),
                          model, tok,
                          run_dir=work / "run", initial=WeightUpdate.full(model, 0),
                          dtype="float32")
    try:
        disk = push_times(engine, model, work / "run" / "weights", 1, args.repeats)[:2]
        tmpfs = push_times(engine, model, Path("/dev/shm/tiller-vllm-sync"), 100,
                           args.repeats)[:2]
        shm = push_times(engine, model, work / "run" / "weights", 200, args.repeats, "shm")[:2]
        probe = list(range(1, 65))
        ours = torch.log_softmax(model(torch.tensor([probe])).logits[0, :-1], -1)
        ref = ours.gather(1, torch.tensor(probe[1:])[:, None])[:, 0]
        parity = (torch.tensor(engine.score(probe)) - ref).abs().max().item()
    finally:
        engine.close()
    med = statistics.median
    print(f"model {params:.1f}M parameters, fp32; medians of {args.repeats}")
    print("| path | push s (total) | write s | reload s (total - write) | vs save_pretrained |")
    print("|---|---|---|---|---|")
    print(f"| save_pretrained to disk | - | {med(hf):.3f} | - | 1.00x |")
    for name, (total, write) in (("folder on disk", disk), ("folder on /dev/shm", tmpfs),
                                 ("shm segment (tiller_shm engine)", shm)):
        print(f"| {name} | {med(total):.3f} | {med(write):.3f} | "
              f"{med(total) - med(write):.3f} | {med(total) / med(hf):.2f}x |")
    print(f"parity after the last push: max |logprob diff| {parity:.2e}")


if __name__ == "__main__":
    main()
