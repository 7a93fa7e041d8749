"""Gathered vs per-rank weight sync (weight_sync.shards) from 2 trainer ranks to one `tiller
serve` (bf16), in one run: per model, --steps SFT steps with the gathered path (every step
gathers the full weights to rank 0, which diffs and writes the version), then --steps with
per-rank parts (each rank diffs and writes its own shard's part, no gather), weight_sync.mode
auto on both. Per path, the median over the steps after the first (a delta each): the
gather's seconds and bytes (gathered only), the sync's seconds (build + write + every server
applying + parity) and bytes, and per rank its part's seconds and bytes; the first (full)
sync apart. Models: the demo's, and benchmarks/engine.py's ~25M Qwen3 (random weights, the
demo tokenizer).

    PYTHONPATH=src .venv/bin/python benchmarks/shard_sync.py            # ~10 min on 2 cores
    PYTHONPATH=src .venv/bin/python benchmarks/shard_sync.py --quick    # smoke run

Results also go to `<--work>/shard_sync.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from engine import big_model  # benchmarks/engine.py's ~25M Qwen3 (this folder)
from weight_sync import demo_model, loss_batch, millions

from tiller.config import WeightSyncConfig
from tiller.engine.http import HttpEngine
from tiller.engine.servers import ManagedServers, tiller_serve_specs
from tiller.engine.updates import WeightUpdate
from tiller.engine.weight_sync import ShardedSync, WeightSync
from tiller.files import write_file
from tiller.models import load_model, load_tokenizer
from tiller.train.distributed import Leader, TrainerOptions
from tiller.train.ranks import start_ranks

START_TIMEOUT_S = 300.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="the demo checkpoint (default: build the demo's model)")
    p.add_argument("--big", default="512,8,8", help="the ~25M Qwen3: hidden,layers,heads")
    p.add_argument("--steps", type=int, default=4, help="syncs per path (the first is full)")
    p.add_argument("--lr", type=float, default=1e-5, help="the SFT steps' learning rate")
    p.add_argument("--episodes", type=int, default=8, help="expert episodes in the batch")
    p.add_argument("--work", default="runs/bench_shard_sync", help="cache and results folder")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.big, args.steps, args.episodes = "32,2,2", 2, 4
    return args


@contextmanager
def tiller_serve(model_dir: Path, root: Path) -> Iterator[str]:
    """One managed `tiller serve` (bf16, 1 thread) reading weights below `root`; stopped after."""
    root.mkdir(parents=True, exist_ok=True)
    specs = tiller_serve_specs(model_dir, 1, weights_root=root, dtype="bfloat16", threads=1)
    with ManagedServers(specs, log_dir=root, startup_timeout_s=START_TIMEOUT_S) as managed:
        yield managed.urls[0]


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def one_model(label: str, model_dir: Path, args: argparse.Namespace, batch: Any
              ) -> dict[str, Any]:
    root = (Path(args.work) / label.split()[0]).resolve()
    with tiller_serve(model_dir, root) as url:
        engine = HttpEngine([url], weights_dir=root / "weights", request_timeout_s=300.0)
        leader: Leader | None = None
        try:
            engine.update_weights(WeightUpdate.full(load_model(model_dir), 0))
            torch.manual_seed(0)
            leader = start_ranks(load_model(model_dir), 2, TrainerOptions(
                compute_dtype=torch.bfloat16), "local", 600.0)
            assert isinstance(leader, Leader)
            leader.set_optimizer(args.lr)
            cfg = WeightSyncConfig(mode="auto")
            out: dict[str, Any] = {"model": label}
            gathered = WeightSync(leader.publisher, engine, cfg, torch.bfloat16)
            rows = []
            for _ in range(args.steps):
                step = leader.sft_step(batch, 8)
                m = gathered.push()
                rows.append({**m, "gather_s": step["train/gather_s"],
                             "gather_bytes": step["train/gather_bytes"]})
            out["gathered"] = summary(rows, ("gather_s", "gather_bytes"))
            per_rank = ShardedSync(leader, engine, cfg, torch.bfloat16)
            rows = []
            for _ in range(args.steps):
                leader.sft_step(batch, 8)
                rows.append(per_rank.push())
            out["per_rank"] = summary(rows, tuple(f"sync/part{r}_{k}" for r in range(2)
                                                  for k in ("s", "bytes")))
            return out
        finally:
            if leader is not None:
                leader.close()
            engine.close()


def summary(rows: list[dict[str, float]], extra: tuple[str, ...]) -> dict[str, float]:
    """The first (full) sync's seconds and bytes; the medians of the rest (deltas or full, as
    auto chose: sync/kind's median)."""
    later = rows[1:] or rows
    keys = ("sync/time_s", "sync/bytes", "sync/full_bytes", "sync/kind", "sync/changed_frac",
            *extra)
    return {"first_s": rows[0]["sync/time_s"], "first_bytes": rows[0]["sync/bytes"],
            **{k: median(later, k) for k in keys}}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    demo_dir = demo_model(args)
    tokenizer = load_tokenizer(demo_dir)
    big_dir = Path(args.work) / f"qwen3_{args.big.replace(',', '_')}"
    if not (big_dir / "config.json").is_file():
        big = big_model(tokenizer, *(int(x) for x in args.big.split(",")))
        big.save_pretrained(big_dir)
        tokenizer.save_pretrained(big_dir)
    batch = loss_batch(tokenizer, args.episodes)
    res: dict[str, Any] = {"args": vars(args), "load_before": os.getloadavg()[0], "rows": []}
    for label, path in ((f"demo {millions(load_model(demo_dir))}", demo_dir),
                        (f"qwen3 {millions(load_model(big_dir))}", big_dir)):
        row = one_model(label, path, args, batch)
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    res["load_after"] = os.getloadavg()[0]
    write_file(Path(args.work) / "shard_sync.json", json.dumps(res, indent=2),
               root=Path(args.work))
    return res


if __name__ == "__main__":
    main()
