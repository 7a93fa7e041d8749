"""What writing traces.sqlite costs: the same RL + eval workload with traces on and off, in
one process, alternating (off, on, off, on, ...) so that a machine busy with something else
slows both alike.

    .venv/bin/python benchmarks/traces.py                # the demo's model and batch, 5 steps
    .venv/bin/python benchmarks/traces.py --quick        # a tiny model, seconds

The workload is the demo (configs/calculator.yaml: 16 tasks x 8 samples per step, 256 eval
episodes before and after RL) from one SFT checkpoint (`--model`, or a short SFT of the demo's
model trained here first, which traces do not touch), with every episode traced
(sample_rate 1). The wall time is `train()`'s whole run (model load, tool gate, eval, RL, eval,
checkpoint), so the ratio is the cost relative to everything but SFT: an upper bound of the
cost relative to the demo's wall time. Each pair of runs also checks that traces left the
training numbers exactly as they were.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tiller.config import load_config  # noqa: E402
from tiller.controller import train  # noqa: E402

QUICK_MODEL = ["model.build.hidden_size=64", "model.build.vocab_size=600",
               "model.build.corpus_tasks=60", "sft.tasks=64", "sft.batch_size=32"]
QUICK_RUN = ["rl.tasks_per_step=4", "rl.group_size=4", "eval.tasks=32"]
# the training numbers that must not move (per RL step, and the held-out results)
SAME = ("loss", "grad_norm", "reward_mean", "success_rate", "response_tokens_mean",
        "advantage_abs_mean")


def sft_checkpoint(out: Path, quick: bool) -> Path:
    """A short SFT of the demo's model (one epoch), trained once into `out`."""
    folder = out / "sft"
    if not (folder / "checkpoints/sft").is_dir():
        print(f"training the SFT checkpoint into {folder} ...", flush=True)
        cfg = load_config(ROOT / "configs/calculator.yaml",
                          [*(QUICK_MODEL if quick else []), "sft.epochs=1", "rl.steps=0",
                           "eval.tasks=8", "logging.progress=false", "logging.tensorboard=false",
                           "observe.traces.enabled=false"])
        train(cfg, folder)
    return folder / "checkpoints/sft"


def run_once(model: Path, traces: bool, args: argparse.Namespace, out: Path) -> dict:
    overrides = [f"model.path={model}", "model.build=null", "sft.enabled=false",
                 f"rl.steps={args.steps}", f"seed={args.seed}", "logging.progress=false",
                 "logging.tensorboard=false", f"observe.traces.enabled={str(traces).lower()}",
                 "observe.traces.sample_rate=1.0", *(QUICK_RUN if args.quick else []), *args.set]
    shutil.rmtree(out, ignore_errors=True)  # a run folder's files are appended to
    t0 = time.perf_counter()
    summary = train(load_config(ROOT / "configs/calculator.yaml", overrides), out)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    same = [[r[k] for k in SAME if k in r] for r in rows if r["phase"] == "rl"]
    for phase in ("heldout_after_sft", "heldout_after_rl"):
        same.append([summary[phase]["success"], summary[phase]["reward_mean"]])
    final = next((r for r in rows if r["phase"] == "traces"), {})
    db = out / "traces.sqlite"
    return {"traces": traces, "wall_s": wall, "rl_s": summary["rl"]["wall_s"],
            "written": final.get("traces/written", 0.0),
            "writer_cpu_s": final.get("traces/writer_cpu_s", 0.0),
            "put_s": final.get("traces/put_s", 0.0),
            "dropped": final.get("traces/dropped_queue", 0.0)
            + final.get("traces/dropped_cap", 0.0),
            "mb": sum(p.stat().st_size for p in out.glob("traces.sqlite*")) / 2**20
            if db.exists() else 0.0, "numbers": same}


def table(runs: list[dict]) -> str:
    off = [r for r in runs if not r["traces"]]
    on = [r for r in runs if r["traces"]]
    lines = ["| traces | wall s (each run) | median wall s | median RL s | episodes written | "
             "dropped | traces.sqlite MiB | writer CPU s (share of wall) | "
             "time in put calls s (share of wall) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, rs in (("off", off), ("on", on)):
        walls = ", ".join(f"{r['wall_s']:.1f}" for r in rs)
        wall = statistics.median(r["wall_s"] for r in rs)
        cpu = statistics.median(r["writer_cpu_s"] for r in rs)
        put = statistics.median(r["put_s"] for r in rs)
        lines.append(f"| {label} | {walls} | {wall:.1f} | "
                     f"{statistics.median(r['rl_s'] for r in rs):.1f} | "
                     f"{rs[0]['written']:.0f} | {rs[0]['dropped']:.0f} | {rs[0]['mb']:.1f} | "
                     f"{cpu:.2f} ({cpu / wall:.1%}) | {put:.2f} ({put / wall:.1%}) |")
    ratio = statistics.median(r["wall_s"] for r in on) / statistics.median(
        r["wall_s"] for r in off)
    pairs = [b["wall_s"] / a["wall_s"] for a, b in zip(off, on, strict=True)]
    lines.append(f"\non / off wall time (medians): {ratio:.3f} (overhead {ratio - 1:+.1%}); "
                 f"per pair: {', '.join(f'{p:.3f}' for p in pairs)}")
    same = all(r["numbers"] == off[0]["numbers"] for r in runs)
    lines.append(f"training numbers identical with traces on and off: {'yes' if same else 'NO'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None,
                    help="SFT checkpoint (default: a one-epoch SFT trained here first)")
    ap.add_argument("--steps", type=int, default=5, help="RL steps per run")
    ap.add_argument("--repeats", type=int, default=2, help="(off, on) pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides, a.b=value")
    ap.add_argument("--quick", action="store_true", help="a tiny model and batch")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench_traces")
    args = ap.parse_args()
    model = args.model or sft_checkpoint(args.out, args.quick)
    runs = []
    for i in range(args.repeats):
        for traces in (False, True):
            print(f"run {i + 1}/{args.repeats}, traces {'on' if traces else 'off'} ...",
                  flush=True)
            runs.append(run_once(model, traces, args, args.out / f"{i}_{traces}"))
    print(table(runs))
    if any(r["numbers"] != runs[0]["numbers"] for r in runs):
        sys.exit(1)  # traces changed training: a bug, whatever the timing says


if __name__ == "__main__":
    main()
