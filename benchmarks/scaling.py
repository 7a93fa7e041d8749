"""The scaling benchmark: the same RL config and seed under cluster.backend local and ray, with
1 or 2 rollout workers and 1 or 2 trainer ranks, and with the engine embedded or one managed
`tiller serve` (engine.backend http, engine.servers 1, runtime.threads 1: under ray the server
in a Ray actor of its own).

For each variant, one `train` of --steps RL steps (no SFT, no evaluation: RL alone is timed)
from the same model (--model, e.g. the demo's SFT checkpoint; else the demo's untrained model
is built), and from its summary and metrics.jsonl:

  s/step          RL's wall time over its steps (Ray's start and the workers' start excluded:
                  `start_s` is the run's time before RL)
  samples/s       trained episodes per second of RL
  trainer busy    the share of RL's wall time spent in train steps
  train ms/ktok   a train step's seconds per 1,000 trained tokens (prompt + response), mean
                  over steps: the trainer ranks' cost per token. The tokens are estimated as
                  episode_tokens_mean x groups_kept x group_size (the step's metrics carry no
                  trainer token count), the same estimate in every variant
  overhead        s/step over the local 1-worker 1-rank variant's with the same engine
                  (`local`, or `local-serve` for the serve variants), minus 1

    PYTHONPATH=src .venv/bin/python benchmarks/scaling.py --model runs/demo/checkpoints/sft
    PYTHONPATH=src .venv/bin/python benchmarks/scaling.py --quick      # smoke run

Results also go to `<--work>/scaling.json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiller.config import load_config
from tiller.controller import train
from tiller.files import write_file

# (name, backend, rollout workers, trainer ranks, engine: embedded or serve)
VARIANTS = [("local", "local", 1, 1, "embedded"), ("ray-1w", "ray", 1, 1, "embedded"),
            ("ray-2w", "ray", 2, 1, "embedded"), ("local-2r", "local", 1, 2, "embedded"),
            ("ray-1w-2r", "ray", 1, 2, "embedded"), ("local-serve", "local", 1, 1, "serve"),
            ("ray-serve", "ray", 1, 1, "serve")]
SERVE = ["engine.backend=http", "engine.servers=1", "runtime.threads=1"]
QUICK = ["model.build.hidden_size=64", "model.build.vocab_size=600",
         "model.build.corpus_tasks=60", "rl.tasks_per_step=4", "rl.group_size=4"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/calculator.yaml")
    p.add_argument("--model", default=None, help="a checkpoint to start RL from (default: the "
                   "config's model, built untrained)")
    p.add_argument("--steps", type=int, default=5, help="RL steps per variant")
    p.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    p.add_argument("--work", default="runs/scaling")
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 steps, 4x4 episodes")
    args = p.parse_args(argv)
    known = [v[0] for v in VARIANTS]
    unknown = [name for name in args.variants.split(",") if name not in known]
    if unknown:  # a typo would otherwise run fewer variants and exit 0
        p.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return args


def run_variant(args: argparse.Namespace, backend: str, workers: int, ranks: int, engine: str,
                out: Path) -> dict[str, Any]:
    overrides = [f"cluster.backend={backend}", f"train.world_size={ranks}",
                 f"rl.steps={args.steps}", "sft.enabled=false", "eval.enabled=false",
                 "logging.progress=false", "logging.report=false", "logging.tensorboard=false",
                 "observe.traces.enabled=false"]
    if backend == "ray":
        overrides.append(f"cluster.rollout_workers={workers}")
    if engine == "serve":
        overrides += SERVE
    if args.model:
        overrides += [f"model.path={args.model}", "model.build=null"]
    if args.quick:
        overrides += QUICK
    if out.exists():  # ours; a fresh run refuses a run's record
        shutil.rmtree(out)
    t0 = time.perf_counter()
    summary = train(load_config(args.config, overrides), out)
    total = time.perf_counter() - t0
    rl = summary["rl"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [r for r in rows if r["phase"] == "rl" and "train_s" in r]
    per_ktok = [1e6 * r["train_s"] / (r["episode_tokens_mean"] * r["groups_kept"]
                                       * summary_group_size(out)) for r in steps]
    return {"s_per_step": rl["wall_s"] / args.steps, "samples_per_s": rl["samples_per_s"],
            "trainer_busy": rl["trainer_busy_frac"],
            "train_ms_per_ktok": statistics.mean(per_ktok),
            "start_s": total - rl["wall_s"], "total_s": total}


def summary_group_size(out: Path) -> int:
    """rl.group_size as the run's config.yaml recorded it."""
    import yaml

    return int(yaml.safe_load((out / "config.yaml").read_text())["rl"]["group_size"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.steps = 2
    work = Path(args.work)
    chosen = args.variants.split(",")
    results: dict[str, dict[str, Any]] = {}
    bases = {}
    for name, backend, workers, ranks, engine in VARIANTS:
        bases[name] = "local-serve" if engine == "serve" else "local"
        if name in chosen:
            results[name] = run_variant(args, backend, workers, ranks, engine, work / name)
            print(name, json.dumps(results[name]), flush=True)
    print(f"{'variant':<11} {'s/step':>7} {'samples/s':>9} {'busy':>5} {'ms/ktok':>8} "
          f"{'start_s':>7} {'overhead':>8}")
    for name, r in results.items():
        base = results.get(bases[name])
        overhead = f"{r['s_per_step'] / base['s_per_step'] - 1:+.1%}" if base else "-"
        r["overhead"] = (r["s_per_step"] / base["s_per_step"] - 1) if base else None
        print(f"{name:<11} {r['s_per_step']:7.2f} {r['samples_per_s']:9.1f} "
              f"{r['trainer_busy']:5.2f} {r['train_ms_per_ktok']:8.1f} {r['start_s']:7.1f} "
              f"{overhead:>8}")
    met = goals(results)
    for goal, ok in met.items():
        print(f"goal {goal}: {'met' if ok else 'NOT met' if ok is False else 'not measured'}")
    work.mkdir(parents=True, exist_ok=True)
    write_file(work / "scaling.json", json.dumps(
        {"args": vars(args), "results": results, "goals": met}, indent=2), root=work)
    return 0


def goals(results: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    """The issue's two goals, each met (True), not (False) or not measured (None, a variant
    missing):

      ray overhead <= 10%:       s_per_step(ray-1w) / s_per_step(local) - 1 <= 0.10
      2 ranks <= 1.3x per token: train_ms_per_ktok(local-2r) / train_ms_per_ktok(local) <= 1.3
    """
    def ratio(name: str, base: str, key: str) -> float | None:
        if name not in results or base not in results:
            return None
        return results[name][key] / results[base][key]

    overhead = ratio("ray-1w", "local", "s_per_step")
    per_token = ratio("local-2r", "local", "train_ms_per_ktok")
    return {"ray overhead <= 10% of step time": None if overhead is None else overhead <= 1.1,
            "2-rank train time per token <= 1.3x 1-rank": None if per_token is None
            else per_token <= 1.3}


if __name__ == "__main__":
    sys.exit(main())
