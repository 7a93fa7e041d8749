"""The weight sync benchmark: bytes and seconds of full and delta syncs to a bf16 embedded engine.

Tables (models: the demo's, and a ~25M-parameter Qwen3 with random weights and the demo
tokenizer, as in benchmarks/engine.py):

  bytes   after ONE real optimizer step (the trainer's AdamW, betas (0.9, 0.99), on the SFT loss
          of scripted-expert calculator episodes) at each --lrs: the fraction of bf16 weights
          whose value changed, the delta's bytes (LEB128 index gaps + bf16 values) over a full
          sync's, a naive int32 index + value encoding's over full, and what `auto` ships.
  seconds a full sync (`WeightSync.build` + `update_weights`: checksums, the engine's control
          call, one `copy_` casting fp32 -> bf16) over an in-place `copy_` of the same tensors
          into the engine's, and the pre-issue-9 path (`WeightUpdate.full` clone +
          `load_state_dict`) over the same copy; medians of --repeats. A delta sync's seconds:
          the median over --steps consecutive optimizer steps at the first of --lrs.
  parity  the mean and max |logprob difference| between the fp32 trainer (autocast to the
          engine dtype, as in a run) and the engine on the 64-token probe, per engine dtype.

    PYTHONPATH=src .venv/bin/python benchmarks/weight_sync.py \\
        --model runs/seeds/seed0/checkpoints/sft      # the demo's SFT checkpoint
    PYTHONPATH=src .venv/bin/python benchmarks/weight_sync.py --quick     # smoke run

Without --model the demo's model is built (untrained) under --work. Results also go to
`<--work>/<--label>.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from engine import big_model  # benchmarks/engine.py's 25.7M Qwen3 (this folder)
from transformers import PreTrainedModel

from tiller.config import BuildConfig, WeightSyncConfig
from tiller.engine.delta import DeltaUpdate
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.updates import WeightUpdate
from tiller.engine.weight_sync import WeightSync
from tiller.envs import ENVS
from tiller.models import build_env_model, load_model, load_tokenizer
from tiller.rollout.agent_loop import EpisodeLimits
from tiller.rollout.collect import collect_expert
from tiller.runtime import apply_threads
from tiller.train.batch import Batch
from tiller.train.trainer import Trainer

DEMO_BUILD = BuildConfig(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=8)
QUICK_BUILD = BuildConfig(vocab_size=600, hidden_size=64, num_layers=2, num_heads=4,
                          corpus_tasks=60)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="the demo checkpoint (default: build the demo's model)")
    p.add_argument("--big", default="512,8,8", help="the ~25M Qwen3: hidden,layers,heads")
    p.add_argument("--lrs", default="1e-6,3e-4", help="learning rates of the one step")
    p.add_argument("--episodes", type=int, default=8, help="expert episodes in the loss batch")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats (median)")
    p.add_argument("--steps", type=int, default=3, help="delta syncs timed (one per step)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--work", default="runs/bench_weight_sync", help="cache and results folder")
    p.add_argument("--label", default="now", help="names the results file <work>/<label>.json")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a seconds-long smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.big, args.episodes, args.repeats, args.steps = "32,2,2", 4, 2, 2
    return args


def demo_model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    out = Path(args.work) / ("demo_quick" if args.quick else "demo")
    if (out / "config.json").is_file():
        return out
    print(f"building the demo's model in {out}", file=sys.stderr)
    return build_env_model(ENVS["calculator"], out, QUICK_BUILD if args.quick else DEMO_BUILD,
                           seed=0, difficulty=2, max_turns=6)


def loss_batch(tokenizer: Any, n: int) -> Batch:
    """Scripted-expert calculator episodes (half guessing, as in SFT): a real LM loss."""
    env = ENVS["calculator"]
    trajs = collect_expert(env, env.make_tasks("train", n, 0, 2), tokenizer, guess=0.5,
                           limits=EpisodeLimits(6, 512), seed=0)
    return Batch.collate(trajs, tokenizer.pad_token_id)


def millions(model: torch.nn.Module) -> str:
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def setup(model: PreTrainedModel, mode: str, lr: float = 1e-6
          ) -> tuple[Trainer, EmbeddedEngine, WeightSync]:
    """A fresh fp32 trainer on a copy of `model`, a bf16 engine, and their sync (first push
    done: the engine holds version 0)."""
    trainer = Trainer(copy.deepcopy(model), compute_dtype=torch.bfloat16)
    trainer.set_optimizer(lr)
    engine = EmbeddedEngine(copy.deepcopy(model).to(torch.bfloat16), 0)
    sync = WeightSync(trainer, engine, WeightSyncConfig(mode=mode), torch.bfloat16)
    sync.push()
    return trainer, engine, sync


def send(sync: WeightSync) -> dict[str, float]:
    """A sync without the parity check: build, apply (the engine verifies the checksums)."""
    update, metrics = sync.build(sync.trainer.version)
    sync.engine.update_weights(update)
    sync.base = sync.trainer.version
    return metrics


def bytes_row(label: str, model: PreTrainedModel, batch: Batch, lr: float) -> dict[str, Any]:
    trainer, engine, sync = setup(model, "delta", lr)
    try:
        trainer.sft_step(batch, micro_batch_size=8)
        update, m = sync.build(trainer.version)
        assert isinstance(update, DeltaUpdate)
        changed = sum(d.values.numel() for d in update.deltas.values())
        full = m["sync/full_bytes"]
        return {"model": label, "lr": lr, "changed_pct": 100 * m["sync/changed_frac"],
                "delta_pct": 100 * update.nbytes / full, "naive_pct": 100 * changed * 6 / full,
                "auto": "delta" if update.nbytes < full else "full", "full_MB": full / 1e6}
    finally:
        engine.close()


def seconds_row(label: str, model: PreTrainedModel, batch: Batch, lr: float, repeats: int,
                steps: int) -> dict[str, Any]:
    trainer, engine, sync = setup(model, "full")
    try:
        dst = list({p.data_ptr(): p for p in engine.model.state_dict().values()}.values())
        src = list({p.data_ptr(): p for p in trainer.model.state_dict().values()}.values())

        @torch.no_grad()
        def copy_in_place() -> None:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)

        def before() -> None:  # clone everything, then load_state_dict copies again
            update = WeightUpdate.full(trainer.model, trainer.version)
            with torch.no_grad():
                engine.model.load_state_dict(update.tensors)

        copy_s = median_s(copy_in_place, repeats)
        full_s = median_s(lambda: send(sync), repeats)
        before_s = median_s(before, repeats)
        parity_s = median_s(lambda: sync.check_parity(trainer.version), repeats)
    finally:
        engine.close()
    trainer, engine, sync = setup(model, "delta", lr)
    try:
        times, changed = [], []
        for _ in range(steps):
            trainer.sft_step(batch, micro_batch_size=8)
            t0 = time.perf_counter()
            m = send(sync)
            times.append(time.perf_counter() - t0)
            changed.append(m["sync/changed_frac"])
    finally:
        engine.close()
    return {"model": label, "copy_ms": 1e3 * copy_s, "full_ms": 1e3 * full_s,
            "full_vs_copy": full_s / copy_s, "before_vs_copy": before_s / copy_s,
            "delta_ms": 1e3 * statistics.median(times), "delta_lr": lr,
            "delta_changed_pct": 100 * statistics.median(changed), "parity_ms": 1e3 * parity_s}


def parity_rows(label: str, model: PreTrainedModel) -> list[dict[str, Any]]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        trainer = Trainer(copy.deepcopy(model), compute_dtype=dtype)
        engine = EmbeddedEngine(copy.deepcopy(model).to(dtype), 0)
        try:
            sync = WeightSync(trainer, engine, WeightSyncConfig(), dtype)
            m = sync.check_parity(0)
        finally:
            engine.close()
        rows.append({"model": label, "engine_dtype": str(dtype).removeprefix("torch."),
                     "mean_abs": m["sync/parity_mean_abs"], "max_abs": m["sync/parity_max_abs"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    cells = [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    apply_threads(args.threads)
    path = demo_model(args)
    tokenizer = load_tokenizer(path)
    demo = load_model(path, torch.float32)
    big = big_model(tokenizer, *(int(x) for x in args.big.split(",")))
    models = [(f"demo {millions(demo)}", demo), (f"qwen3 {millions(big)}", big)]
    batch = loss_batch(tokenizer, args.episodes)
    lrs = [float(x) for x in args.lrs.split(",")]
    res: dict[str, Any] = {"args": vars(args)}
    res["bytes"], res["seconds"], res["parity"] = [], [], []
    for label, m in models:
        print(f"measuring {label}", file=sys.stderr)
        res["bytes"] += [bytes_row(label, m, batch, lr) for lr in lrs]
        res["seconds"].append(seconds_row(label, m, batch, lrs[0], args.repeats, args.steps))
        res["parity"] += parity_rows(label, m)
    for name in ("bytes", "seconds", "parity"):
        print(f"\n== {name}\n{table(res[name])}")
    out = Path(args.work) / f"{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
