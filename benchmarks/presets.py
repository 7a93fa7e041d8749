"""Compare the algorithm presets on the calculator demo, from one shared SFT checkpoint.

The SFT cold start runs once (or `--sft-checkpoint` reuses one, e.g. a run's
`checkpoints/sft`); then every preset's RL starts from that same checkpoint with the same seed
and budget (`model.path=<sft>`, `model.build=null`, `sft.enabled=false`) and is evaluated on
the same held-out tasks. Prints a table (also written to `results.md` and `results.json` in the
output folder):

    preset | held-out success | 95% CI | tasks | RL wall s | tokens/s | zero-var | vs grpo ...

`vs grpo` columns are ratios to the `grpo` preset measured in the same invocation. tokens/s is
generated tokens in RL rollouts (every dynamic-sampling round included) per second of RL wall
time (rollouts + updates). For PPO the critic's explained variance at the first and last step
is shown too.

    # quick check that everything runs (a few minutes on 2 CPU cores)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/presets.py --quick
    # the real comparison (see docs/algorithms.md, "Measured")
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/presets.py --steps 30 --eval-tasks 256
"""

from __future__ import annotations

import argparse
import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tiller.algorithms.presets import PRESETS
from tiller.config import load_config
from tiller.controller import evaluate, rl, sft
from tiller.run import Run

# a tiny model and SFT: enough to prove every preset runs, not to compare them
QUICK = ["model.build.hidden_size=64", "model.build.vocab_size=600",
         "model.build.corpus_tasks=60", "sft.tasks=32", "sft.epochs=1",
         "rl.tasks_per_step=2", "rl.group_size=4"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/calculator.yaml")
    p.add_argument("--sft-checkpoint", help="reuse this SFT checkpoint instead of running SFT")
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated; grpo first")
    p.add_argument("--steps", type=int, help="RL steps per preset (default: the config's)")
    p.add_argument("--eval-tasks", type=int, help="held-out tasks (default: the config's)")
    p.add_argument("--tasks-per-step", type=int, help="groups per RL step")
    p.add_argument("--group-size", type=int, help="samples per group")
    p.add_argument("--seed", type=int, help="one seed for every preset (default: the config's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (repeatable)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model and SFT, --steps 2 --eval-tasks 16 unless given")
    p.add_argument("--out", help="output folder (default: runs/bench-presets-<time>)")
    return p.parse_args()


def budget(args: argparse.Namespace) -> list[str]:
    """Overrides that every stage shares, flags last so they win."""
    out = [*(QUICK if args.quick else []), *args.set, "logging.tensorboard=false"]
    for flag, key in [("steps", "rl.steps"), ("eval_tasks", "eval.tasks"),
                      ("tasks_per_step", "rl.tasks_per_step"), ("group_size", "rl.group_size"),
                      ("seed", "seed")]:
        value = getattr(args, flag)
        if value is None and args.quick:
            value = {"steps": 2, "eval_tasks": 16}.get(flag)
        if value is not None:
            out.append(f"{key}={value}")
    return out


def heldout(run: Run) -> list[Any]:
    return run.tasks("heldout", run.cfg.eval.tasks, 0)


def cold_start(args: argparse.Namespace, out: Path) -> tuple[Path, dict[str, Any]]:
    """Build the model and run SFT once (or load `--sft-checkpoint`); evaluate it."""
    shared = budget(args)
    if args.sft_checkpoint:
        cfg = load_config(args.config, [*shared, f"model.path={args.sft_checkpoint}",
                                        "model.build=null", "sft.enabled=false"])
        run = Run(cfg, out / "sft")
        path = Path(args.sft_checkpoint)
    else:
        run = Run(load_config(args.config, shared), out / "sft")
        sft(run)
        path = run.save("sft")
    result = evaluate(run, heldout(run), "sft")
    run.close()
    return path, result


def rl_run(args: argparse.Namespace, out: Path, sft: Path, preset: str) -> dict[str, Any]:
    # the preset replaces the config's algorithm section; --set rl.algorithm.* applies on top
    cfg = load_config(args.config, [f"rl.algorithm={{preset: {preset}}}", *budget(args),
                                    f"model.path={sft}", "model.build=null", "sft.enabled=false"])
    run = Run(cfg, out / preset)
    t0 = time.perf_counter()
    rl(run)
    rl_s = time.perf_counter() - t0
    result = evaluate(run, heldout(run), "rl")
    run.close()
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["phase"] == "rl"]
    # steps where every return was equal have no explained variance (NaN): skip them
    ev = [r["explained_variance"] for r in rows
          if "explained_variance" in r and not math.isnan(r["explained_variance"])]
    return {
        "preset": preset, "success": result["success"], "ci_low": result["ci_low"],
        "ci_high": result["ci_high"], "tasks": result["tasks"], "rl_s": rl_s,
        "tokens_per_s": sum(r["rollout_tokens"] for r in rows) / max(rl_s, 1e-9),
        "zero_variance_group_frac": sum(r["zero_variance_group_frac"] for r in rows)
        / max(len(rows), 1),
        "explained_variance": (ev[0], ev[-1]) if ev else None,
        "steps": len(rows), "run_dir": str(run.dir),
    }


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "-"


def num(x: float) -> str:
    """Explained variance is undefined (NaN) while every return is equal."""
    return "-" if math.isnan(x) else f"{x:.2f}"


def table(sft: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["preset"] == "grpo"), None)
    head = ["preset", "held-out success", "95% CI", "tasks", "RL wall s", "tokens/s",
            "zero-var frac", "success vs grpo", "time vs grpo", "PPO expl. var. first -> last"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append(f"| (SFT start) | {sft['success']:.3f} | [{sft['ci_low']:.3f}, "
                 f"{sft['ci_high']:.3f}] | {sft['tasks']} | | | | | | |")
    for r in rows:
        ev = r["explained_variance"]
        cells = [r["preset"], f"{r['success']:.3f}", f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
                 str(r["tasks"]), f"{r['rl_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                 f"{r['zero_variance_group_frac']:.2f}",
                 ratio(r["success"], base["success"]) if base else "-",
                 ratio(r["rl_s"], base["rl_s"]) if base else "-",
                 f"{num(ev[0])} -> {num(ev[1])}" if ev else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = sorted(set(presets) - set(PRESETS))
    if unknown:
        raise SystemExit(f"error: unknown presets {unknown}; choose from {', '.join(PRESETS)}")
    presets.sort(key=lambda p: p != "grpo")  # the baseline first
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or Path("runs") / f"bench-presets-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sft_path, sft = cold_start(args, out)
    rows = []
    for preset in presets:
        rows.append(rl_run(args, out, sft_path, preset))
        print(f"{preset}: success {rows[-1]['success']:.3f} in {rows[-1]['rl_s']:.1f}s",
              flush=True)
    md = table(sft, rows)
    (out / "results.md").write_text(md + "\n")
    (out / "results.json").write_text(json.dumps(
        {"sft_checkpoint": str(sft_path), "sft": sft, "presets": rows,
         "overrides": budget(args), "total_s": time.perf_counter() - t0}, indent=2))
    print(md)
    print(f"\nSFT checkpoint: {sft_path}\nresults: {out / 'results.md'}, "
          f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
