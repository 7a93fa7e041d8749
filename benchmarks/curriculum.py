"""Curriculum vs uniform sampling on the calculator, over several seeds (docs/curriculum.md).

Per seed: SFT once on easier problems (sft.difficulty = --sft-difficulty), then one RL run per
arm from that same checkpoint, with the same seed and budget, at the target env.difficulty:

    uniform     RL tasks drawn at the target difficulty (rl.curriculum off)
    difficulty  rl.curriculum mode difficulty: levels 1..target, starting at 1, kept in the
                band [0.3, 0.7]
    filter      rl.curriculum mode filter: a pool of --pool train tasks at the target, those
                whose own success estimate is outside the band skipped

Every arm is evaluated on the same held-out tasks at the target difficulty after SFT and every
--eval-every RL steps. Reported per seed: held-out success at the end (95% bootstrap CI over
tasks) and each curriculum arm minus uniform, paired on the same tasks (paired bootstrap CI,
sign-test p); the curve mean (held-out success averaged over the evaluations after step 0: the
area under the learning curve); steps-to-threshold, where a seed's threshold is what uniform
reaches at its last step ("the same held-out success"): the first evaluated step at which each
arm reaches it. Over seeds: means with a 95% t-interval, and the table keeps the arms every
merged seed ran. Ratios are arm / uniform, measured in the same invocation.

    .venv/bin/python benchmarks/curriculum.py --seeds 0 1 2        # docs/curriculum.md
    .venv/bin/python benchmarks/curriculum.py --quick               # smoke test (tests/)

One process per seed and --merge give the same table in less wall time on two cores.
--shared-sft runs one SFT for every seed, --sft-checkpoint skips SFT: then only RL varies by
seed, and the spread over seeds says nothing about SFT's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tiller.config import load_config  # noqa: E402
from tiller.controller import evaluate, rl, sft  # noqa: E402
from tiller.observe.compare import compare, load_outcomes  # noqa: E402
from tiller.observe.compare import format_diff as fmt_diff  # noqa: E402
from tiller.observe.compare import format_success as fmt  # noqa: E402
from tiller.run import Run  # noqa: E402

# a tiny model and SFT, two steps: proves the benchmark runs end to end, measures nothing
QUICK = ["model.build.hidden_size=32", "model.build.num_heads=2", "model.build.vocab_size=400",
         "model.build.corpus_tasks=40", "sft.tasks=16", "sft.epochs=1", "sft.batch_size=8",
         "sft.micro_batch_size=8", "sft.warmup_steps=0", "sampling.max_new_tokens=24",
         "env.max_turns=3"]
ARMS = ("uniform", "difficulty", "filter")
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/learning/calculator.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                   help="uniform is the baseline and always runs")
    p.add_argument("--target", type=int, default=3, help="env.difficulty of RL and eval")
    p.add_argument("--sft-difficulty", type=int, default=2)
    p.add_argument("--sft-tasks", type=int, help="default: the config's sft.tasks")
    p.add_argument("--sft-epochs", type=int, help="default: the config's sft.epochs")
    p.add_argument("--shared-sft", action="store_true",
                   help="one SFT (with the first seed) for every seed: only RL varies by seed")
    p.add_argument("--sft-checkpoint", type=Path,
                   help="start every seed's RL from this checkpoint instead of running SFT")
    p.add_argument("--steps", type=int, default=60, help="RL steps per arm")
    p.add_argument("--tasks-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-tasks", type=int, default=256)
    p.add_argument("--pool", type=int, default=128, help="filter arm: tasks in the pool")
    p.add_argument("--max-skips", type=int, default=4,
                   help="filter arm: skips in a row before a task is drawn anyway")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (repeatable)")
    p.add_argument("--quick", action="store_true", help="tiny model and SFT, 2 steps, 8 tasks")
    p.add_argument("--out", help="output folder (default: runs/bench-curriculum-<time>)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="DIR",
                   help="print one table from the results.json of earlier runs (e.g. one "
                        "process per seed) instead of running anything")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    args.arms = ["uniform", *(a for a in ARMS if a in args.arms and a != "uniform")]
    changed = [name for name in ("steps", "eval_every", "eval_tasks", "pool", "tasks_per_step",
                                 "group_size", "target", "sft_difficulty", "sft_tasks",
                                 "sft_epochs")
               if getattr(args, name) != p.get_default(name)]
    if args.quick and changed:  # --quick sets them: a flag beside it would change nothing
        p.error(f"--quick fixes the budget; drop --{changed[0].replace('_', '-')}")
    sft_flags = [f for f in changed if f.startswith("sft_")] + (["shared_sft"]
                                                                 if args.shared_sft else [])
    if args.sft_checkpoint is not None and sft_flags:  # no SFT runs
        p.error(f"--sft-checkpoint skips SFT; drop --{sft_flags[0].replace('_', '-')}")
    if args.quick:
        args.steps, args.eval_every, args.eval_tasks, args.pool = 2, 1, 8, 4
        args.tasks_per_step, args.group_size, args.target = 2, 4, 3
        args.sft_tasks, args.sft_epochs = 16, 1
    return args


def overrides(args: argparse.Namespace, seed: int) -> list[str]:
    sft_budget = [f"sft.{k}={v}" for k, v in (("tasks", args.sft_tasks),
                                                ("epochs", args.sft_epochs)) if v is not None]
    return [*(QUICK if args.quick else []), *args.set, f"seed={seed}",
            "logging.tensorboard=false", "logging.progress=false", *sft_budget,
            f"env.difficulty={args.target}", f"rl.steps={args.steps}",
            f"rl.tasks_per_step={args.tasks_per_step}", f"rl.group_size={args.group_size}",
            f"eval.tasks={args.eval_tasks}"]


def arm_overrides(args: argparse.Namespace, name: str) -> list[str]:
    """What each arm changes; everything else is the same for all arms."""
    on = ["rl.curriculum.enabled=true", f"rl.curriculum.mode={name}"]
    return {"uniform": [],
            # one step's groups decide a move, over the last window groups of the level
            "difficulty": [*on, "rl.curriculum.start=1",
                           f"rl.curriculum.min_groups={args.tasks_per_step}",
                           f"rl.curriculum.window={max(8, args.tasks_per_step)}"],
            # one group of group_size samples is a task's first estimate
            "filter": [*on, f"rl.curriculum.pool={args.pool}", "rl.curriculum.min_groups=1",
                       "rl.curriculum.window=2", f"rl.curriculum.max_skips={args.max_skips}"]
            }[name]


def cold_start(args: argparse.Namespace, seed: int, out: Path) -> Path:
    """SFT at --sft-difficulty (reused when the folder already holds its checkpoint)."""
    path = out / "sft" / "checkpoints" / "sft"
    if (path / "config.json").is_file():
        return path
    cfg = load_config(args.config, [*overrides(args, seed),
                                    f"sft.difficulty={args.sft_difficulty}", "rl.steps=0"])
    run = Run(cfg, out / "sft")
    try:
        sft(run)
        return run.save("sft")
    finally:
        run.close()


def arm(args: argparse.Namespace, seed: int, sft_path: Path, name: str, out: Path,
        start: dict[str, float] | None = None) -> dict[str, Any]:
    """One RL run from the SFT checkpoint at the target difficulty; held-out success at step 0
    (`start`: already measured on the same checkpoint, tasks and seed, so the same figure) and
    every --eval-every steps."""
    cfg = load_config(args.config, [*overrides(args, seed), f"model.path={sft_path}",
                                    "model.build=null", "sft.enabled=false",
                                    *arm_overrides(args, name)])
    run = Run(cfg, out / name)
    curve: dict[int, dict[str, float]] = {}
    try:
        heldout = run.tasks("heldout", cfg.eval.tasks, 0)
        curve[0] = start if start is not None else evaluate(run, heldout, "step0")

        def after_step(step: int) -> None:
            if step % args.eval_every == 0 or step == args.steps:
                curve[step] = evaluate(run, heldout, f"step{step}")

        t0 = time.perf_counter()
        rl(run, after_step)
        rl_s = time.perf_counter() - t0
    finally:
        run.close()
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["phase"] == "rl"]
    return {"arm": name, "curve": {s: e["success"] for s, e in curve.items()},
            "start": curve[0], "final": curve[max(curve)], "rl_s": rl_s,
            "levels": [r["curriculum/difficulty"] for r in steps
                       if "curriculum/difficulty" in r],
            "skipped": steps[-1].get("curriculum/skipped_total", 0.0),
            "zero_variance": statistics.fmean(r["zero_variance_group_frac"] for r in steps),
            "train_success": statistics.fmean(r["success_rate"] for r in steps),
            "run_dir": str(run.dir), "label": f"step{max(curve)}"}


def paired(row: dict[str, Any], name: str) -> dict[str, float]:
    """Arm `name` minus uniform at the last step, paired on the same held-out tasks."""
    u, a = row["uniform"], row[name]
    return compare(load_outcomes(f"{u['run_dir']}:{u['label']}")[1],
                   load_outcomes(f"{a['run_dir']}:{a['label']}")[1], "heldout", row["seed"])


def curve_mean(curve: dict[Any, float]) -> float:
    """Mean held-out success over the evaluations after step 0: the area under the learning
    curve per evaluation, which reads every point, where steps-to-threshold reads one."""
    return statistics.fmean(v for s, v in curve.items() if int(s) > 0)


def uniform_gained(row: dict[str, Any]) -> bool:
    """Did uniform end above the SFT start? If not, every arm "reaches" its final success at
    step 0 and steps-to-threshold says nothing (shown n/a)."""
    return row["threshold"] > row["uniform"]["start"]["success"]


def steps_to(curve: dict[int, float], threshold: float) -> int | None:
    """The first evaluated step whose held-out success reaches `threshold` (None: never)."""
    return next((s for s in sorted(curve) if curve[s] >= threshold), None)


def mean_ci(xs: list[float]) -> str:
    """Mean over seeds with a 95% t-interval (n - 1 degrees of freedom)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "-"
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return f"{m:.3f}"
    half = T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return f"{m:.3f} [{m - half:.3f}, {m + half:.3f}]"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def fmt_steps(s: int | str | None, budget: int) -> str:
    return str(s) if s is not None else f"> {budget}"


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = ["seed", "arm", "SFT start", f"held-out at step {args.steps} [95% CI]",
            "- uniform (paired) [95% CI], p", "curve mean", "threshold", "steps to threshold",
            "steps ratio", "train success", "zero-variance groups", "levels (first -> last)",
            "skipped", "RL s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    arms = [a for a in ARMS if all(a in r for r in results)]
    for r in results:
        su = r["steps"]["uniform"]
        for name in arms:
            a, s = r[name], r["steps"][name]
            lv = a["levels"]
            lines.append("| " + " | ".join([
                str(r["seed"]), name, f"{a['start']['success']:.3f}", fmt(a["final"]),
                fmt_diff(r["paired"][name]) if name != "uniform" else "-",
                f"{curve_mean(a['curve']):.3f}", f"{r['threshold']:.3f}",
                fmt_steps(s, args.steps) if uniform_gained(r) else "n/a",
                ratio(s, su) if uniform_gained(r) and s is not None and name != "uniform"
                else "-",
                f"{a['train_success']:.3f}", f"{a['zero_variance']:.2f}",
                f"{lv[0]:.0f} -> {lv[-1]:.0f}" if lv else "-", f"{a['skipped']:.0f}",
                f"{a['rl_s']:.0f}"]) + " |")
    gained = [r for r in results if uniform_gained(r)]
    lines += ["", f"over {len(results)} seeds (mean [95% t-interval]); steps to uniform's final "
              f"success over the {len(gained)} seeds where uniform gained on SFT:"]
    for name in arms:
        finals = [r[name]["final"]["success"] for r in results]
        steps = [float(r["steps"][name]) if r["steps"][name] is not None else math.nan
                 for r in gained]
        line = f"- {name}: held-out at step {args.steps} {mean_ci(finals)}"
        line += f"; curve mean {mean_ci([curve_mean(r[name]['curve']) for r in results])}"
        if name != "uniform":
            diffs = [r["paired"][name]["diff"] for r in results]
            line += f", minus uniform (paired by seed): at step {args.steps} {mean_ci(diffs)}"
            gaps = [curve_mean(r[name]["curve"]) - curve_mean(r["uniform"]["curve"])
                    for r in results]
            line += f", curve mean {mean_ci(gaps)}"
        line += (f"; steps {mean_ci(steps)} (seeds not reaching it within {args.steps}: "
                 f"{sum(math.isnan(x) for x in steps)})")
        lines.append(line)
    return "\n".join(lines)


def merge(dirs: list[Path]) -> str:
    """One table over the seeds of several earlier invocations with the same budget."""
    runs = [json.loads((d / "results.json").read_text()) for d in dirs]
    free = ("seeds", "out", "merge", "arms")  # what may differ between merged invocations
    # a flag added since an invocation ran: it ran with the flag's default
    defaults = vars(parse_args([]))
    budget = {**defaults, **runs[0]["args"]}
    budget = {k: v for k, v in budget.items() if k not in free}
    for d, r in zip(dirs, runs, strict=True):
        other = {k: v for k, v in {**defaults, **r["args"]}.items() if k not in free}
        if other != budget:
            raise SystemExit(f"error: {d} ran with another budget: {other} != {budget}")
    rows = [row for r in runs for row in r["results"]]
    seeds = [row["seed"] for row in rows]
    if len(set(seeds)) < len(seeds):  # a seed counted twice would narrow the t-interval
        raise SystemExit(f"error: the folders repeat a seed: {sorted(seeds)}")
    md = table(rows, argparse.Namespace(**budget))
    print(md)
    return md


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or Path("runs") / f"bench-curriculum-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    shared = args.sft_checkpoint or (cold_start(args, args.seeds[0], out / "shared")
                                     if args.shared_sft else None)
    for seed in args.seeds:
        sft_path = shared or cold_start(args, seed, out / f"seed{seed}")
        row: dict[str, Any] = {"seed": seed, "sft_checkpoint": str(sft_path)}
        for name in args.arms:
            start = row["uniform"]["start"] if name != "uniform" else None
            row[name] = arm(args, seed, sft_path, name, out / f"seed{seed}", start)
            print(f"seed {seed} {name}: curve {row[name]['curve']} "
                  f"({row[name]['rl_s']:.0f} s RL)", flush=True)
        row["threshold"] = row["uniform"]["final"]["success"]
        row["steps"] = {a: steps_to(row[a]["curve"], row["threshold"])
                        if uniform_gained(row) else None for a in args.arms}
        row["paired"] = {a: paired(row, a) for a in args.arms if a != "uniform"}
        results.append(row)
        (out / "results.json").write_text(json.dumps(
            {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
             "results": results}, indent=2))
    md = table(results, args)
    (out / "results.md").write_text(md + "\n")
    print(md)
    print(f"\nresults: {out / 'results.md'}, total {time.perf_counter() - t0:.0f} s")
    return md


if __name__ == "__main__":
    main()
