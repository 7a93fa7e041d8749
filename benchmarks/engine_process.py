"""The embedded engine in the trainer's process against the same engine in a `tiller serve`
process of its own (`engine.backend=http engine.servers=1`): generated tokens per second of
the RL rollouts (multi-turn calculator episodes), summed over the RL steps, on the demo's
config with a shortened SFT (the policy calls the tool, so episodes have several turns).

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_process.py

Both runs use runtime.threads=1 and the same seed; the run folders go under --work.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from tiller.config import load_config
from tiller.controller import train

SHORT = ["sft.tasks=640", "sft.epochs=2", "rl.steps=3", "eval.tasks=16",
         "logging.progress=false", "logging.report=false", "runtime.threads=1"]
SETUPS = {"in-process (embedded)": ["engine.backend=embedded"],
          "subprocess (tiller serve)": ["engine.backend=http", "engine.servers=1"]}


def rollout_rate(run_dir: Path) -> tuple[float, float, float]:
    """(tokens, seconds, turns per episode) of the RL rollouts in `run_dir`."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    turns = sum(r.get("turns_mean", 0.0) for r in rl) / len(rl)
    return sum(r["rollout_tokens"] for r in rl), sum(r["rollout_s"] for r in rl), turns


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/tiller-engine-process")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override after the shortened run's (e.g. rl.steps=1); the "
                    "documented figures use none")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    print("| engine | rollout tokens | rollout s | tokens/s | turns/episode |")
    print("|---|---|---|---|---|")
    results = {}
    for name, more in SETUPS.items():
        out = Path(args.work) / name.split()[0]
        if out.exists():  # ours; a fresh run refuses a run's record
            shutil.rmtree(out)
        train(load_config("configs/calculator.yaml", [*SHORT, *args.set, *more]), out)
        tokens, seconds, turns = rollout_rate(out)
        results[name] = {"tokens": tokens, "seconds": seconds, "turns": turns}
        print(f"| {name} | {tokens:.0f} | {seconds:.1f} | {tokens / seconds:.0f} | "
              f"{turns:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
