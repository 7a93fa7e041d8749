"""sync, one_step_off and async RL on a long-tail agentic workload, from one SFT checkpoint.

    .venv/bin/python benchmarks/async_vs_sync.py                 # the demo model, 25 steps
    .venv/bin/python benchmarks/async_vs_sync.py --quick         # a tiny model, seconds
    .venv/bin/python benchmarks/async_vs_sync.py --modes sync async \
        --off-policy none tis mis decoupled                       # async once per correction

The workload is the calculator demo with a heavy-tailed tool latency (env.tools.faults): 90%
of tool calls sleep `--fast-s`, 10% sleep `--slow-factor` (30) times longer, drawn per call
from a seeded RNG. A sleep costs no CPU, so the latency is what an agent's slow tools cost: time
in which a synchronous trainer idles. Each mode starts from the same SFT checkpoint with the
same seed and the same algorithm, and trains the same number of samples (rl.steps x
tasks_per_step x group_size); the held-out success after RL comes with its 95% CI. Each mode
other than sync runs once per off-policy correction in `--off-policy` (default: the mode's
own default, `rl.algorithm.off_policy` left unset; `none` is run with
allow_uncorrected_off_policy); sync runs once, with its default (none: its samples are
on-policy). Ratios are against the sync run of the same invocation ("-" without one, e.g.
`--modes async` to compare corrections only).
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

DEMO_SFT = ROOT / "runs/seeds/seed0/checkpoints/sft"
QUICK = ["rl.tasks_per_step=4", "rl.group_size=4", "eval.tasks=32",
         "sampling.max_new_tokens=24"]
TINY_MODEL = ["model.build.hidden_size=64", "model.build.vocab_size=600",
              "model.build.corpus_tasks=60", "sft.tasks=64", "sft.epochs=1",
              "sft.batch_size=32", "rl.steps=0", "eval.tasks=8"]


def sft_checkpoint(out: Path, quick: bool) -> Path:
    """The demo's SFT model (trained once, here, when there is none yet)."""
    if not quick and DEMO_SFT.is_dir():
        return DEMO_SFT
    folder = out / "sft"
    if not (folder / "checkpoints/sft").is_dir():
        print(f"training the SFT checkpoint into {folder} ...", flush=True)
        cfg = load_config(ROOT / "configs/calculator.yaml",
                          (TINY_MODEL if quick else ["rl.steps=0"]) + ["logging.progress=false"])
        if folder.exists():  # an attempt cut short: a fresh run refuses its record
            shutil.rmtree(folder)
        train(cfg, folder)
    return folder / "checkpoints/sft"


def run_mode(mode: str, correction: str | None, model: Path, args: argparse.Namespace,
             out: Path) -> dict:
    faults = (f"{{latency_s: {args.fast_s}, slow_prob: 0.1, "
              f"slow_s: {args.fast_s * args.slow_factor}, seed: {args.seed}}}")
    overrides = [f"model.path={model}", "model.build=null", "sft.enabled=false",
                 f"rl.steps={args.steps}", f"rl.mode={mode}", f"seed={args.seed}",
                 f"env.tools.faults={faults}", "logging.progress=false",
                 "logging.tensorboard=false", *(QUICK if args.quick else [])]
    if correction is not None:
        overrides.append(f"rl.algorithm.off_policy={correction}")
    if correction == "none":
        overrides.append("rl.algorithm.allow_uncorrected_off_policy=true")
    if mode == "async":
        overrides.append(f"rl.max_staleness={args.max_staleness}")
    overrides += args.set
    cfg = load_config(ROOT / "configs/calculator.yaml", overrides)
    run_dir = out / f"{mode}-{cfg.rl.algorithm.off_policy}"
    if run_dir.exists():  # ours; a fresh run refuses a run's record
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    summary = train(cfg, run_dir)
    rl, heldout = summary["rl"], summary["heldout_after_rl"]
    return {"mode": mode, "off_policy": cfg.rl.algorithm.off_policy,
            "samples_per_s": rl["samples_per_s"], "wall_s": rl["wall_s"],
            "trainer_busy": rl["trainer_busy_frac"], "engine_busy": rl.get("engine_busy_frac"),
            "rollout_train": rl["rollout_train_ratio"],
            "staleness_mean": rl.get("staleness_mean", 0.0),
            "staleness_max": rl.get("staleness_max", 0),
            "trained": rl["ledger"]["trained"], "stale": rl["ledger"].get("filtered/stale", 0),
            "started": rl["ledger"]["started"], "success": heldout["success"],
            "ci": (heldout["ci_low"], heldout["ci_high"]),
            "total_s": time.perf_counter() - t0}


def vs_sync(row: dict, base: dict | None) -> str:
    return "-" if base is None else f"{row['samples_per_s'] / base['samples_per_s']:.2f}x"


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["mode"] == "sync"), None)  # no sync: no ratios
    head = ("| mode | off_policy | trained samples/s | vs sync | RL wall s | trainer busy | "
            "engine busy | rollout/train | staleness mean / max | started / trained / filtered "
            "stale | held-out success [95% CI] |\n|" + "---|" * 11)
    lines = [head]
    for r in rows:
        engine = "-" if r["engine_busy"] is None else f"{r['engine_busy']:.0%}"
        lines.append(
            f"| {r['mode']} | {r['off_policy']} | {r['samples_per_s']:.2f} | "
            f"{vs_sync(r, base)} | {r['wall_s']:.1f} | "
            f"{r['trainer_busy']:.0%} | {engine} | {r['rollout_train']:.2f} | "
            f"{r['staleness_mean']:.2f} / {r['staleness_max']} | "
            f"{r['started']} / {r['trained']} / {r['stale']} | "
            f"{r['success']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None,
                    help="SFT checkpoint (default: the seed-0 demo's, trained if absent)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--modes", nargs="+", default=["sync", "one_step_off", "async"])
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--off-policy", nargs="+", default=None,
                    help="rl.algorithm.off_policy values; each mode but sync runs once per "
                         "value (default: once, with the mode's default correction)")
    ap.add_argument("--fast-s", type=float, default=0.2, help="latency of 90%% of tool calls")
    ap.add_argument("--slow-factor", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides, a.b=value")
    ap.add_argument("--quick", action="store_true", help="a tiny model and few steps")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/async_vs_sync")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.fast_s = min(args.steps, 3), min(args.fast_s, 0.01)
    model = args.model or sft_checkpoint(args.out, args.quick)
    rows = []
    for mode in args.modes:
        for correction in ([None] if mode == "sync" else args.off_policy or [None]):
            print(f"{mode} {correction or '(default correction)'} ...", flush=True)
            rows.append(run_mode(mode, correction, model, args, args.out))
    print(table(rows))
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
