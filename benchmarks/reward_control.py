"""The spurious-reward control: RL from one SFT checkpoint on the verifier's reward vs on a
random reward (`rl.reward_control=random`), over several seeds, held-out success with 95% CIs
and paired comparisons on the same tasks.

    .venv/bin/python benchmarks/reward_control.py                  # the demo, seeds 0 1 2
    .venv/bin/python benchmarks/reward_control.py --quick          # a tiny model, seconds

The SFT checkpoint is trained once (configs/calculator.yaml with rl.steps=0, seed --sft-seed)
into OUT/sft-seed<S> unless it is there already or --sft names one. Each seed then runs two
RL runs from it that differ only in rl.reward_control: none (the verifier's 0/1 success) and
random (each step's verifier rewards shuffled across the step's trajectories: the same mean
and distribution, no link to behaviour). Each run evaluates the SFT model and its RL model on
the same held-out tasks (the seed picks them), so the table's differences are paired: a
paired-bootstrap 95% CI over tasks and the exact McNemar p-value (`tiller compare`). A run
whose summary.json exists is reused, so an interrupted benchmark resumes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tiller.config import load_config  # noqa: E402
from tiller.controller import train  # noqa: E402
from tiller.observe.compare import compare, load_outcomes  # noqa: E402
from tiller.observe.compare import format_diff as fmt_diff  # noqa: E402
from tiller.observe.compare import format_success as fmt  # noqa: E402

CONTROLS = ("none", "random")
QUICK = ["model.build.hidden_size=64", "model.build.vocab_size=600",
         "model.build.corpus_tasks=60", "sft.tasks=64", "sft.epochs=1", "sft.batch_size=32",
         "rl.steps=2", "rl.tasks_per_step=4", "rl.group_size=4", "eval.tasks=8",
         "sampling.max_new_tokens=24"]
QUIET = ["logging.progress=false", "logging.tensorboard=false"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/calculator.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sft-seed", type=int, default=0, help="seed of the SFT run")
    p.add_argument("--sft", type=Path, help="an SFT checkpoint to start from (default: "
                                            "OUT/sft-seed<S>/checkpoints/sft, trained if absent)")
    p.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for the SFT run (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every RL run (repeatable)")
    p.add_argument("--out", type=Path, default=ROOT / "runs/bench-reward-control")
    p.add_argument("--quick", action="store_true", help="a tiny model and 2 RL steps")
    return p.parse_args(argv)


def sft_checkpoint(args: argparse.Namespace) -> Path:
    if args.sft is not None:
        return args.sft
    folder = args.out / f"sft-seed{args.sft_seed}"
    if not (folder / "checkpoints/sft").is_dir():
        print(f"training the SFT checkpoint into {folder} ...", file=sys.stderr, flush=True)
        if folder.exists():  # an attempt cut short: a fresh run refuses a run's record
            shutil.rmtree(folder)
        train(load_config(args.config, [*(QUICK if args.quick else []), "rl.steps=0",
                                        f"seed={args.sft_seed}", *QUIET, *args.sft_set]),
              folder)
    return folder / "checkpoints/sft"


def rl_run(args: argparse.Namespace, sft: Path, seed: int, control: str) -> Path:
    out = args.out / f"seed{seed}" / control
    if (out / "summary.json").is_file():
        return out  # done by an earlier invocation
    if out.exists():  # an attempt cut short: a fresh run refuses a run's record
        shutil.rmtree(out)
    t0 = time.perf_counter()
    overrides = [*(QUICK if args.quick else []), f"model.path={json.dumps(str(sft))}",
                 "model.build=null", "sft.enabled=false", f"seed={seed}",
                 f"rl.reward_control={control}", *QUIET, *args.set]
    train(load_config(args.config, overrides), out)
    print(f"seed {seed}, reward_control={control}: {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    return out


def seed_row(args: argparse.Namespace, sft: Path, seed: int) -> dict:
    runs = {c: rl_run(args, sft, seed, c) for c in CONTROLS}
    _, base = load_outcomes(f"{runs['none']}:sft")  # the SFT model on this seed's tasks
    _, real = load_outcomes(f"{runs['none']}:rl")
    _, rand = load_outcomes(f"{runs['random']}:rl")
    summaries = {c: json.loads((runs[c] / "summary.json").read_text()) for c in CONTROLS}
    return {"seed": seed,
            "sft": summaries["none"]["heldout_after_sft"],
            "real": summaries["none"]["heldout_after_rl"],
            "random": summaries["random"]["heldout_after_rl"],
            "real_vs_sft": compare(base, real), "random_vs_sft": compare(base, rand),
            "real_vs_random": compare(rand, real)}


def table(rows: list[dict]) -> str:
    lines = ["| seed | SFT [95% CI] | RL, real reward | RL, random reward | real - SFT "
             "[paired 95% CI], McNemar p | random - SFT | real - random |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {fmt(r['sft'])} | {fmt(r['real'])} | {fmt(r['random'])} "
                     f"| {fmt_diff(r['real_vs_sft'])} | {fmt_diff(r['random_vs_sft'])} | "
                     f"{fmt_diff(r['real_vs_random'])} |")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    lines.append(f"| mean | {mean([r['sft']['success'] for r in rows]):.3f} | "
                 f"{mean([r['real']['success'] for r in rows]):.3f} | "
                 f"{mean([r['random']['success'] for r in rows]):.3f} | "
                 + " | ".join(f"{mean([r[k]['diff'] for r in rows]):+.3f}"
                              for k in ("real_vs_sft", "random_vs_sft", "real_vs_random"))
                 + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sft = sft_checkpoint(args)
    rows = [seed_row(args, sft, seed) for seed in args.seeds]
    print(f"\n{args.config}, SFT checkpoint {sft}, {rows[0]['sft']['tasks']} held-out tasks per "
          "seed, one sample each\n")
    print(table(rows))
    (args.out / "table.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
