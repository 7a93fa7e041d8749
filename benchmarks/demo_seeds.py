"""The demo over several seeds: held-out success after SFT and after SFT + GRPO, per seed
with its 95% bootstrap CI, then the mean, min and max over seeds.

    .venv/bin/python benchmarks/demo_seeds.py --seeds 0 1 2

Each seed is one `tiller train CONFIG seed=S` run, in sequence (each uses the machine's cores).
The CIs resample held-out tasks only: they say how much the figure would move on other tasks
of the same distribution, not how much it moves with the seed or on another CPU, which is what
the spread over seeds shows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/calculator.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (repeatable)")
    p.add_argument("--out", help="output folder (default: runs/bench-demo-seeds-<time>)")
    return p.parse_args()


def run_seed(config: str, seed: int, extra: list[str], out: Path) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "tiller", "train", config, f"seed={seed}",
           "logging.progress=false", *extra, "-o", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    summary["wall_s"] = time.perf_counter() - t0
    return summary


def fmt(row: dict) -> str:
    return f"{row['success']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]"


def main() -> None:
    args = parse_args()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"runs/bench-demo-seeds-{stamp}")
    rows = []
    for seed in args.seeds:
        s = run_seed(args.config, seed, args.set, out / f"seed{seed}")
        sft, rl = s["heldout_after_sft"], s["heldout_after_rl"]
        rows.append({"seed": seed, "sft": sft, "rl": rl, "gain": rl["success"] - sft["success"],
                     "overlap": rl["ci_low"] <= sft["ci_high"], "wall_s": s["wall_s"],
                     "tool_calls": (sft["tool_calls_per_episode"],
                                    rl["tool_calls_per_episode"])})
        print(f"seed {seed} done in {s['wall_s']:.0f} s", file=sys.stderr)

    print(f"\n{args.config}, {rows[0]['sft']['tasks']} held-out tasks per seed\n")
    print("| seed | after SFT [95% CI] | after SFT + GRPO [95% CI] | gain | CIs overlap "
          "| tool calls/episode | wall |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {fmt(r['sft'])} | {fmt(r['rl'])} | {r['gain']:+.3f} | "
              f"{'yes' if r['overlap'] else 'no'} | {r['tool_calls'][0]:.2f} -> "
              f"{r['tool_calls'][1]:.2f} | {r['wall_s']:.0f} s |")
    for name, key in (("after SFT", "sft"), ("after SFT + GRPO", "rl")):
        xs = [r[key]["success"] for r in rows]
        print(f"\n{name}: mean {sum(xs) / len(xs):.3f}, min {min(xs):.3f}, max {max(xs):.3f}")
    gains = [r["gain"] for r in rows]
    print(f"gain: mean {sum(gains) / len(gains):+.3f}, min {min(gains):+.3f}, "
          f"max {max(gains):+.3f}")
    (out / "table.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
